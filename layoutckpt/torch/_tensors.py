"""Zero-copy conversion between torch tensors and NumPy arrays, bf16 and fp8 included.

``Tensor.numpy()`` refuses dtypes NumPy lacks, so those go through a same-width integer view
and are reinterpreted as the ``ml_dtypes`` type: no bytes are copied either way.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..format._dtypes import ZARR_TO_NUMPY
from ._torch import torch

ZARR_NAMES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
)
# Dtypes NumPy cannot hold natively, and the same-width integer used to carry their bits.
_CARRIER_NAMES = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


@functools.cache
def _tables() -> tuple[dict[Any, str], dict[str, Any], dict[Any, Any]]:
    """torch dtype -> zarr name, its inverse, and the carriers; built (importing torch) on first use."""
    to_zarr = {getattr(torch, n): n for n in ZARR_NAMES}
    carriers = {getattr(torch, n): getattr(torch, c) for n, c in _CARRIER_NAMES.items()}
    return to_zarr, {v: k for k, v in to_zarr.items()}, carriers


def zarr_name_of(dtype: Any) -> str | None:
    """The stored dtype name of a torch dtype, or None where it has none."""
    return _tables()[0].get(dtype)


def torch_dtype(zarr_dtype: str) -> Any:
    return _tables()[1][zarr_dtype]


def tensor_zarr_dtype(t: torch.Tensor, name: str) -> str:
    """The stored dtype name of the tensor leaf ``name``; ``TypeError`` naming it for a tensor
    that cannot be stored (a dtype without a stored name, a sparse layout, no data)."""
    if t.layout != torch.strided:
        raise TypeError(
            f"array {name!r} is a {t.layout} tensor; layoutckpt stores dense tensors only: save "
            "t.to_dense(), or its indices and values as arrays of their own"
        )
    if t.is_meta:
        raise TypeError(
            f"array {name!r} is on the meta device and holds no data; materialize it (e.g. "
            "module.to_empty(device='cpu') and initialize or load it) before saving"
        )
    found = zarr_name_of(t.dtype)
    if found is None:
        raise TypeError(
            f"array {name!r}: dtype {t.dtype} cannot be stored; supported dtypes are "
            f"{sorted(f'torch.{n}' for n in ZARR_NAMES)}; cast it before saving"
        )
    return found


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (bf16/fp8 as ml_dtypes), sharing its memory; a copy where
    the tensor is a lazy negation (``torch._neg_view``, a view of a conjugate's imaginary part),
    whose memory holds the values negated."""
    t = t.detach().resolve_neg()
    if not t.is_cpu:
        t = t.cpu()
    to_zarr, _, carriers = _tables()
    carrier = carriers.get(t.dtype)
    if carrier is None:
        return t.numpy()
    return t.view(carrier).numpy().view(ZARR_TO_NUMPY[to_zarr[t.dtype]])


def from_numpy(a: np.ndarray, zarr_dtype: str) -> torch.Tensor:
    """A torch tensor sharing ``a``'s memory, of the torch dtype matching ``zarr_dtype``."""
    dtype = torch_dtype(zarr_dtype)
    carrier = _tables()[2].get(dtype)
    if not a.flags.writeable:
        a = a.copy()
    if carrier is None:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(np.dtype(str(carrier).removeprefix("torch.")))).view(dtype)
