"""The documentation: README.md stays a one-screen pitch that starts with the two commands CI
reads, and the API reference documents every public name, and no private one.

The reference pages are written when the site is built (docs/hooks.py, ``reference_pages``: one
mkdocstrings ``:::`` directive per name of each public module's ``__all__``, read from the source
without importing anything, as griffe reads it); the tests read those directives, and where
mkdocs is installed (``pip install -e ".[docs]"``) build the site with ``--strict`` and find
every documented name in it. tests/test_public_api.py checks that ``__all__`` itself is right.
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from test_public_api import PACKAGE, public_modules

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), os.pardir))

# The two commands README.md starts with: .ci/run runs the second as written.
DEMO_COMMAND = 'pip install ".[demo]" && richness demo'
TEST_COMMAND = 'pip install torch==2.13.0 ".[test]" && python -m pytest -q tests'



def load_hooks():
    """docs/hooks.py as a module (it needs mkdocs only when mkdocs calls it)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "hooks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOKS = load_hooks()


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
    pages, problems = HOOKS.reference_pages()
    assert not problems, problems
    return "\n".join(pages.values())


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
    assert set(public_modules()) == set(HOOKS.public_modules())
    missing = []
    for module in public_modules():
        if module in HOOKS.NOT_YET:
            continue
        names = static_all(module)
        if names and module != "richness":
            assert module in documented, f"{module}: no `::: {module}` (its docstring) in the API reference"
        for name in names:
            full = f"{module}.{name}"
            if full not in documented and full not in aliases:
                missing.append(full)
    assert not missing, f"public names missing from the API reference: {missing}"


def test_reference_shows_nothing_private():
    for ident in directives(reference_text()):
        parts = ident.split(".")
        private = [p for p in parts if p.startswith("_") and not (p.startswith("__") and p.endswith("__"))]
        assert not private, f"the API reference documents the private {ident}"
        assert parts[0] == "richness", ident


def test_reference_pages_are_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        config = f.read()
    for page, _, _ in HOOKS.REFERENCE_PAGES:
        assert page in config, page


def test_generator_can_fail():
    """A public name that the generator would leave out is found by the check above."""
    exported, imported = HOOKS.module_info("richness.monitor")
    assert exported == ["Monitor", "Window", "EveryStep", "Probe", "Head", "Layer"]
    assert HOOKS.resolve("richness.monitor", "Monitor") == ("richness.monitor.monitor", "Monitor")
    assert HOOKS.resolve("richness", "Moments") == ("richness._engine.moments", "Moments")
    assert "::: richness.Moments" in reference_text()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason='the site needs pip install -e ".[docs]"')
def test_site_builds_strict(tmp_path):
    """Every warning (a broken link or anchor, a docstring griffe cannot read, a missing
    reference) fails the build."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    html = "".join((tmp_path / "site" / "reference" / f"{os.path.basename(page)[:-3]}.html").read_text(encoding="utf-8")
                   for page, _, _ in HOOKS.REFERENCE_PAGES)
    ids = set(re.findall(r'id="([^"]+)"', html))
    modules = set(public_modules())  # a module's directive shows its docstring, under the page's heading
    absent = [ident for ident in directives(reference_text()) if ident not in ids and ident not in modules]
    assert not absent, f"documented names the built site does not show: {absent}"
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()
