"""Optional dependencies: every message about a missing one names a pip extra
that pyproject.toml declares, and the integrations' own import errors say it."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PACKAGE = os.path.join(ROOT, "python", "richness")


def declared_extras():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def named_extras():
    """Every extra the package's sources name: pip_extra("x") calls, _require(..., "x")
    calls and literal richness[x] in messages and docstrings."""
    found = {}
    patterns = (r"pip_extra\(['\"](\w+)['\"]\)", r"richness\[(\w+)\]", r"_require\([^)]*['\"](\w+)['\"]\)",
                r"_optional\([^)]*['\"](\w+)['\"]\)")
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                for pattern in patterns:
                    for extra in re.findall(pattern, text):
                        found.setdefault(extra, os.path.relpath(path, PACKAGE))
    return found


def test_every_extra_a_message_names_is_declared():
    named, declared = named_extras(), declared_extras()
    assert {"torch", "torchmetrics", "lightning", "transformers", "wandb", "mlflow", "dask", "h5py", "pyarrow",
            "safetensors", "plot", "progress"} <= set(named)
    missing = {extra: where for extra, where in named.items() if extra not in declared}
    assert not missing, f"extras named but not in pyproject.toml: {missing}"


BLOCKED_IMPORT = """
import sys
for name in sys.argv[2:]:
    sys.modules[name] = None  # import raises ImportError, as if not installed
try:
    __import__(sys.argv[1])
except ImportError as e:
    print(e)
"""


@pytest.mark.parametrize("module,blocked,extra", [
    ("richness.torchmetrics", ["torchmetrics"], "torchmetrics"),
    ("richness.lightning", ["lightning", "pytorch_lightning"], "lightning"),
    ("richness.transformers", ["transformers"], "transformers"),
])
def test_an_integration_without_its_library_names_its_extra(module, blocked, extra):
    out = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, module, *blocked], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert f'pip install "richness[{extra}]"' in out.stdout, out.stdout


def test_plots_and_progress_bars_without_their_library_name_their_extras(monkeypatch):
    from richness import _optional, plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r'pip install "richness\[plot\]"'):
        plot._plt()
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r'pip install "richness\[progress\]"'):
        _optional.require_tqdm("richness.evaluate")
