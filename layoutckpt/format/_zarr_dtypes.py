"""Teach zarr-python the extension data types TensorStore writes: bfloat16 and float8.

zarr-python 3 has no built-in ``bfloat16`` or ``float8_*`` data type, so without this a plain
``zarr.open_array`` of such an array fails. Registering them (backed by ``ml_dtypes``) keeps the
promise that every array layoutckpt writes opens in plain zarr. Importing layoutckpt registers
them; nothing else in zarr changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

try:
    from zarr.core.dtype import data_type_registry
    from zarr.core.dtype.npy.float import BaseFloat
except ImportError:  # zarr-python missing or of another major version: nothing to register
    data_type_registry = None
    BaseFloat = None


def _make(zarr_name: str, scalar: Any) -> type:
    native = np.dtype(scalar)

    @dataclass(frozen=True, kw_only=True)
    class ExtensionFloat(BaseFloat):  # type: ignore[misc, valid-type]
        dtype_cls = type(native)
        _zarr_v3_name: ClassVar[str] = zarr_name
        _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

        @classmethod
        def _check_native_dtype(cls, dtype: Any) -> bool:
            return np.dtype(dtype) == native

        @classmethod
        def from_native_dtype(cls, dtype: Any) -> Any:
            if cls._check_native_dtype(dtype):
                return cls(endianness="little")
            raise TypeError(f"{dtype} is not {zarr_name}")

        def to_native_dtype(self) -> np.dtype:
            return native

        @property
        def item_size(self) -> int:
            return native.itemsize

    ExtensionFloat.__name__ = ExtensionFloat.__qualname__ = "".join(p.capitalize() for p in zarr_name.split("_"))
    return ExtensionFloat


def register() -> None:
    if data_type_registry is None or BaseFloat is None:
        return
    for name, scalar in (
        ("bfloat16", ml_dtypes.bfloat16),
        ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
        ("float8_e5m2", ml_dtypes.float8_e5m2),
    ):
        if name not in data_type_registry.contents:
            data_type_registry.register(name, _make(name, scalar))
