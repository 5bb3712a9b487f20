"""Imports of optional dependencies (torch, tqdm) that fail naming the pip extra to install."""


def require_torch(what: str):
    """Import torch or fail with the extra to install."""
    try:
        import torch
    except ImportError:
        raise ImportError(f'{what} needs PyTorch: pip install "richness[torch]"') from None
    return torch


def require_tqdm(what: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(f'{what} with progress=True needs tqdm: pip install "richness[demo]" '
                          "(or pass progress=False)") from None
    return tqdm


def require_wandb(what: str):
    try:
        import wandb
    except ImportError:
        raise ImportError(f'{what} needs Weights & Biases: pip install "richness[wandb]"') from None
    return wandb


def require_mlflow(what: str):
    try:
        import mlflow
    except ImportError:
        raise ImportError(f'{what} needs MLflow: pip install "richness[mlflow]"') from None
    return mlflow
