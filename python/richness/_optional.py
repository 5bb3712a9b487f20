"""Imports of optional dependencies (torch, tqdm, wandb, mlflow) that fail naming the pip extra to install."""

import importlib


def _require(module: str, what: str, name: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f'{what} needs {name}: pip install "richness[{extra}]"') from None


def require_torch(what: str):
    """Import torch or fail with the extra to install."""
    return _require("torch", what, "PyTorch", "torch")


def require_tqdm(what: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(f'{what} with progress=True needs tqdm: pip install "richness[demo]" '
                          "(or pass progress=False)") from None
    return tqdm


def require_wandb(what: str):
    return _require("wandb", what, "Weights & Biases", "wandb")


def require_mlflow(what: str):
    return _require("mlflow", what, "MLflow", "mlflow")
