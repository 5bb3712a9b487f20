"""The torch integration: reading a torch model and its loaders. Finding and
hooking its head and layers (``hooks.py``), taking rows, labels and tokens
from loader batches (``batches.py``), the thread policy of core updates
under torch (``threads.py``), ``evaluate``, one pass over a loader
(``evaluate.py``), and ``similarity``, CKA between layers of models in one
pass (``similarity.py``).

Named after the library it integrates (as ``safetensors.torch`` is): its
modules' ``import torch`` is absolute and reaches PyTorch itself."""

__all__ = []
