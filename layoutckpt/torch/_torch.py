"""PyTorch, imported only when a tensor needs it.

Reading a checkpoint (``lc.open``, the command line, ``layoutckpt.jax``) needs only NumPy and
TensorStore, so ``import layoutckpt`` must neither need torch nor pay the second or so that
importing it costs. ``torch`` and ``dist`` here import on first use; the checks below look at
``sys.modules`` only, since a tensor or a process group cannot exist before torch is imported.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any


class _Lazy:
    """A module imported on its first attribute access (ImportError then if it is absent).

    Each attribute found is kept on this object: ``__getattr__`` runs only after the ordinary
    lookup has failed, which costs about 1.5 us, and a save or load looks up torch's attributes
    for every tensor it holds. Module attributes are functions, classes and constants, which
    torch does not rebind."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module = sys.modules.get(self._name) or importlib.import_module(self._name)
        value = getattr(module, attr)
        setattr(self, attr, value)
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


torch: Any = _Lazy("torch")
dist: Any = _Lazy("torch.distributed")


def is_tensor(x: Any) -> bool:
    module = sys.modules.get("torch")
    return module is not None and isinstance(x, module.Tensor)


def distributed() -> bool:
    """Whether this process is one rank of an initialized ``torch.distributed`` world."""
    module = sys.modules.get("torch.distributed")
    return module is not None and module.is_available() and module.is_initialized()


@functools.cache
def installed() -> bool:
    """Whether torch can be imported (importing it: only asked where a tensor is to be made)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True
