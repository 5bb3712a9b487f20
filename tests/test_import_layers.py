"""Imports point down: every module of the package sits in one layer of docs/ARCHITECTURE.md ("Layers"),
and no import (at module top or inside a function) reaches a higher layer. Read from the source with
``ast``, so the test needs neither the compiled core nor the optional dependencies."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "richness")

# Lowest first; a module belongs to the longest prefix that names it. Keep in step with
# docs/ARCHITECTURE.md, "Layers".
LAYERS = [
    ("base", ["richness._warnings", "richness._checks", "richness._optional", "richness.finish._xp"]),
    ("schema", ["richness._native", "richness._core", "richness._cuda", "richness._state", "richness._report"]),
    ("finish", ["richness.finish"]),
    ("core", ["richness._engine"]),
    ("torch", ["richness.torch"]),
    ("integrations", ["richness.monitor", "richness.torchmetrics", "richness.dask", "richness.baselines",
                      "richness.plot"]),
    ("callbacks", ["richness.lightning", "richness.transformers"]),
    ("api", ["richness"]),
    ("cli", ["richness.cli", "richness.__main__"]),
]


def layer_of(module):
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def module_name(path):
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def is_module(name):
    path = os.path.join(os.path.dirname(PACKAGE), *name.split("."))
    return os.path.exists(path + ".py") or os.path.isdir(path) or name.split(".")[-1] in ("_core", "_cuda")


def modules():
    for folder, _, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(folder, f)


def imports(path):
    """(imported module, line) for every import of the package in the file at ``path``."""
    name = module_name(path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "richness" or base.startswith("richness."):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    yield (sub if is_module(sub) else base), node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "richness" or alias.name.startswith("richness."):
                    yield alias.name, node.lineno


def test_every_module_has_a_layer():
    missing = [module_name(p) for p in modules() if layer_of(module_name(p)) is None]
    assert not missing, f"modules in no layer (add them to LAYERS and docs/ARCHITECTURE.md): {missing}"


def test_imports_point_down():
    upward = []
    for path in modules():
        src = module_name(path)
        for dst, line in imports(path):
            if dst != src and layer_of(dst) > layer_of(src):
                upward.append(f"{src}:{line} ({LAYERS[layer_of(src)][0]}) imports {dst} "
                              f"({LAYERS[layer_of(dst)][0]})")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


@pytest.mark.parametrize("src,dst,upward", [
    ("richness.finish.dlr", "richness.monitor.window", True),
    ("richness._engine.moments", "richness.torch.evaluate", True),
    ("richness.cli.commands", "richness._engine.moments", False),
    ("richness.monitor.monitor", "richness.torch.hooks", False),
])
def test_the_layer_order_flags_an_upward_import(src, dst, upward):
    assert (layer_of(dst) > layer_of(src)) == upward
