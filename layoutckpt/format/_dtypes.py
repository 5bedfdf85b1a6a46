"""Data types: the Zarr v3 names (as TensorStore writes them) and their NumPy equivalents.

bfloat16 and float8 have no NumPy type of their own; ``ml_dtypes`` provides them, and TensorStore
reads and writes arrays of those types directly.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# Zarr v3 data type name -> NumPy dtype. The names are TensorStore's for the extension types.
ZARR_TO_NUMPY: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
NUMPY_TO_ZARR: dict[np.dtype, str] = {v: k for k, v in ZARR_TO_NUMPY.items()}


def zarr_name(dtype: np.dtype, array: str) -> str:
    """The Zarr name of a NumPy dtype, or a ``TypeError`` naming the array and the choices."""
    name = NUMPY_TO_ZARR.get(np.dtype(dtype).newbyteorder("="))
    if name is None:
        raise TypeError(
            f"array {array!r}: dtype {dtype} cannot be stored; supported dtypes are "
            f"{sorted(ZARR_TO_NUMPY)}; cast it to one of them before saving"
        )
    return name


def numpy_dtype(name: str) -> np.dtype:
    try:
        return ZARR_TO_NUMPY[name]
    except KeyError:
        from ..base._errors import FormatError

        raise FormatError(f"unknown stored data type {name!r}; known: {sorted(ZARR_TO_NUMPY)}") from None
