"""The documentation: README.md stays a one-screen pitch that starts with the two commands CI
reads, and the API reference (docs/reference/*.md, mkdocstrings ``:::`` directives) documents
every public name, and no private one.

Public modules and their ``__all__`` are read from the source without importing anything, as
griffe reads them for the site (tests/test_public_api.py checks that ``__all__`` is right).
Where mkdocs is installed (``pip install -e ".[docs]"``), the site is built with ``--strict``.
"""

import ast
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from test_public_api import PACKAGE, public_modules

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir))
REFERENCE = os.path.join(ROOT, "docs", "reference")

# The two commands README.md starts with: .ci/run runs the second as written.
DEMO_COMMAND = 'pip install ".[demo]" && richness demo'
TEST_COMMAND = 'pip install torch==2.13.0 ".[test]" && python -m pytest -q tests'

# Public modules not on the reference pages yet, with their reason.
NOT_YET = {"richness.finish.lidar": "LiDAR is documented with its release"}


def module_path(name: str) -> str:
    parts = name.split(".")[1:]
    base = PACKAGE.joinpath(*parts)
    return str(base / "__init__.py" if base.is_dir() else base.with_suffix(".py"))


def static_all(name: str) -> list:
    """A module's ``__all__`` as written in its source."""
    with open(module_path(name), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{name} declares no __all__")


def reference_text() -> str:
    parts = []
    for path in sorted(glob.glob(os.path.join(REFERENCE, "*.md"))):
        with open(path, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n".join(parts)


def directives(text: str) -> list:
    """The identifiers of the ``::: identifier`` lines."""
    return re.findall(r"^:::\s+(\S+)\s*$", text, flags=re.M)


def test_readme_is_short_and_starts_with_the_two_commands():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.encode("utf-8")) <= 10_000, "README.md is a one-screen pitch: the reference lives in docs/"
    first = re.search(r"```(\w*)\n(.*?)```", text, flags=re.S)
    assert first and first.group(1) == "bash", "README.md's first code block is the bash commands"
    lines = [line.split("#")[0].strip() for line in first.group(2).strip().splitlines()]
    assert lines == [DEMO_COMMAND, TEST_COMMAND]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert TEST_COMMAND in ci, ".ci/run runs README.md's test command as written"


def test_reference_documents_every_public_name():
    text = reference_text()
    documented = set(directives(text))
    # a name re-exported by another public module: a row `mod.name` | [`canonical`][canonical]
    aliases = dict(re.findall(r"^\|\s*`([\w.]+)`\s*\|\s*\[`[\w.]+`\]\[([\w.]+)\]\s*\|", text, flags=re.M))
    assert set(aliases.values()) <= documented, "an alias points to a name without a ::: directive"
    missing = []
    for module in public_modules():
        if module in NOT_YET:
            continue
        names = static_all(module)
        if names and module != "richness":
            assert module in documented, f"{module}: no `::: {module}` (its docstring) in docs/reference/"
        for name in names:
            full = f"{module}.{name}"
            if full not in documented and full not in aliases:
                missing.append(full)
    assert not missing, f"public names missing from docs/reference/*.md: {missing}"


def test_reference_shows_nothing_private():
    for ident in directives(reference_text()):
        parts = ident.split(".")
        private = [p for p in parts if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))]
        assert not private, f"docs/reference/ documents the private {ident}"
        assert parts[0] == "richness", ident


def test_reference_pages_are_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = f.read()
    for path in glob.glob(os.path.join(REFERENCE, "*.md")):
        assert f"reference/{os.path.basename(path)}" in config, path


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason='the site needs pip install -e ".[docs]"')
def test_site_builds_strict(tmp_path):
    """Every warning (a broken link or anchor, a docstring griffe cannot read, a missing
    reference) fails the build."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "richness.html").exists()
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()
