"""Imports of optional dependencies that fail naming the pip extra to install.

Every optional integration has an extra of its own in pyproject.toml
(``[project.optional-dependencies]``), and every message about a missing one
names it in the words of ``pip_extra``."""

import importlib


def pip_extra(extra: str) -> str:
    """The command that installs the optional dependencies of ``extra``."""
    return f'pip install "richness[{extra}]"'


def _require(module: str, what: str, name: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{what} needs {name}: {pip_extra(extra)}") from None


def require_torch(what: str):
    """Import torch or fail with the extra to install."""
    return _require("torch", what, "PyTorch", "torch")


def require_tqdm(what: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(f"{what} with progress=True needs tqdm: {pip_extra('progress')} "
                          "(or pass progress=False)") from None
    return tqdm


def require_wandb(what: str):
    return _require("wandb", what, "Weights & Biases", "wandb")


def require_mlflow(what: str):
    return _require("mlflow", what, "MLflow", "mlflow")
