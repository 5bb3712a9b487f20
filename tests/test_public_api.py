"""The public surface is stated in code: every public module (no component of its
dotted path starts with ``_``) declares ``__all__``, every name listed there
exists and, when it is a module, class or function, says what it is in a
docstring. A public module's names outside ``__all__`` are private.
``richness.__all__`` lists every lazily loaded top-level name."""

import importlib
import inspect
import pathlib

import pytest

import richness

PACKAGE = pathlib.Path(richness.__file__).parent


def public_modules():
    """Dotted names of the public modules, read from the source tree (nothing imported)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("richness",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return names


def import_or_skip(name):
    """Import module ``name``; skip when an optional dependency of it is missing."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("richness"):
            pytest.skip(f"{name} needs {e.name}")
        raise
    except ImportError as e:
        if "pip install" in str(e):  # richness._optional: a missing optional dependency, with its extra
            pytest.skip(str(e))
        raise


def undocumented(obj) -> bool:
    """True when a module, class or function has no docstring of its own (the
    "Name(field, ...)" text that namedtuple and dataclass write does not count);
    constants are exempt."""
    if not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)):
        return False
    doc = (obj.__doc__ or "").strip()
    generated = inspect.isclass(obj) and doc.startswith(f"{obj.__name__}(")
    return not doc or generated


def check_all(module):
    assert hasattr(module, "__all__"), f"{module.__name__} declares no __all__"
    names = list(module.__all__)
    assert all(isinstance(n, str) for n in names), module.__name__
    assert len(names) == len(set(names)), f"{module.__name__}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{module.__name__}.__all__ lists names it does not define: {missing}"
    private = [n for n in names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
    assert not private, f"{module.__name__}.__all__ lists private names: {private}"
    bare = [n for n in names if undocumented(getattr(module, n))]
    assert not bare, f"{module.__name__}: no docstring on {bare}"


def test_public_modules_found():
    found = set(public_modules())
    assert {"richness", "richness.finish", "richness.cli", "richness.dask", "richness.plot", "richness.baselines",
            "richness.torch.evaluate"} <= found
    assert not any(part.startswith("_") for name in found for part in name.split("."))


@pytest.mark.parametrize("name", public_modules())
def test_public_module_declares_all(name):
    module = import_or_skip(name)
    assert (module.__doc__ or "").strip(), f"{name} has no module docstring"
    check_all(module)


def test_top_level_names_import_and_are_documented():
    assert set(richness._PUBLIC) <= set(richness.__all__), "a lazily loaded name is missing from richness.__all__"
    assert len(richness.__all__) == len(set(richness.__all__))
    for name in richness.__all__:
        value = getattr(richness, name)  # loads it (PEP 562)
        assert not undocumented(value), f"richness.{name} has no docstring"
    assert isinstance(richness.__version__, str)
