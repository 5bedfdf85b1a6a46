"""PyTorch when it is installed, ``None`` when it is not.

Reading a checkpoint (``lc.open``, the command line, ``layoutckpt.jax``) needs only NumPy and
TensorStore, so every module imports torch through here and the package imports without it.
Saving torch tensors and loading into them need torch, and only they reach for it.
"""

from __future__ import annotations

from typing import Any

try:
    import torch
    import torch.distributed as dist
except ImportError:  # a NumPy-only environment
    torch = None  # type: ignore[assignment]
    dist = None  # type: ignore[assignment]


def is_tensor(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def distributed() -> bool:
    """Whether this process is one rank of an initialized ``torch.distributed`` world."""
    return dist is not None and dist.is_available() and dist.is_initialized()
