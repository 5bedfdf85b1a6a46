"""Zero-copy conversion between torch tensors and NumPy arrays, bf16 and fp8 included.

``Tensor.numpy()`` refuses dtypes NumPy lacks, so those go through a same-width integer view
and are reinterpreted as the ``ml_dtypes`` type: no bytes are copied either way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._dtypes import ZARR_TO_NUMPY
from ._torch import torch

TORCH_TO_ZARR: dict[Any, str] = (
    {}
    if torch is None
    else {
        torch.bool: "bool",
        torch.int8: "int8",
        torch.int16: "int16",
        torch.int32: "int32",
        torch.int64: "int64",
        torch.uint8: "uint8",
        torch.uint16: "uint16",
        torch.uint32: "uint32",
        torch.uint64: "uint64",
        torch.float16: "float16",
        torch.float32: "float32",
        torch.float64: "float64",
        torch.bfloat16: "bfloat16",
        torch.float8_e4m3fn: "float8_e4m3fn",
        torch.float8_e5m2: "float8_e5m2",
    }
)
ZARR_TO_TORCH = {v: k for k, v in TORCH_TO_ZARR.items()}

# Dtypes NumPy cannot hold natively, and the same-width integer used to carry their bits.
_CARRIERS = (
    {}
    if torch is None
    else {
        torch.bfloat16: torch.int16,
        torch.float8_e4m3fn: torch.uint8,
        torch.float8_e5m2: torch.uint8,
    }
)


def tensor_zarr_dtype(t: torch.Tensor, name: str) -> str:
    try:
        return TORCH_TO_ZARR[t.dtype]
    except KeyError:
        raise TypeError(
            f"array {name!r}: dtype {t.dtype} cannot be stored; supported dtypes are "
            f"{sorted(str(d) for d in TORCH_TO_ZARR)}; cast it before saving"
        ) from None


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (bf16/fp8 as ml_dtypes), sharing its memory."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    carrier = _CARRIERS.get(t.dtype)
    if carrier is None:
        return t.numpy()
    return t.view(carrier).numpy().view(ZARR_TO_NUMPY[TORCH_TO_ZARR[t.dtype]])


def from_numpy(a: np.ndarray, zarr_dtype: str) -> torch.Tensor:
    """A torch tensor sharing ``a``'s memory, of the torch dtype matching ``zarr_dtype``."""
    dtype = ZARR_TO_TORCH[zarr_dtype]
    carrier = _CARRIERS.get(dtype)
    if not a.flags.writeable:
        a = a.copy()
    if carrier is None:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(np.dtype(str(carrier).removeprefix("torch.")))).view(dtype)
