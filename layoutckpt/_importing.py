"""What every importer shares (``import_safetensors``, ``import_dcp``): checking its options,
chunking each imported tensor as a save under the layout would, the root metadata of the result,
and the local destination it writes to."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .base._errors import LayoutError
from .base._version import __version__
from .format._dtypes import numpy_dtype
from .format._format import COMPRESSIONS, ArrayMeta, CheckpointMeta, check_readable
from .format._hierarchy import user_metadata
from .layout import _plan
from .layout._layout import Layout
from .layout._spec import P, check_spec
from .layout._tree import name_to_path
from .storage._location import Location, locate


def check_options(
    layout: Layout | None, step: int | None, compression: str | None, metadata: Mapping[str, Any] | None
) -> Layout:
    """The layout to chunk under (default: replicated), once the options are checked."""
    layout = Layout.replicated() if layout is None else layout
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a layoutckpt Layout, got {type(layout).__name__}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise TypeError(f"step must be an int or None, got {step!r}")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    user_metadata(metadata)
    return layout


def array_meta(
    name: str, shape: tuple[int, ...], dtype: str, layout: Layout, inner_chunk_bytes: int, compression: str | None
) -> ArrayMeta:
    """The document of a whole imported tensor, chunked as a save under ``layout`` would."""
    spec = layout.spec_for(name)
    if not isinstance(spec, P):
        raise LayoutError(
            f"array {name!r}: the layout gives it {spec!r}, but imported tensors are whole arrays; "
            "give it a P(...) rule (a flat buffer's parameters are stored per parameter anyway)"
        )
    check_spec(spec, layout.mesh, len(shape), name, shape)
    outer = _plan.shard_shape(shape, spec, layout.mesh)
    inner = _plan.chunk_shape_for(outer, numpy_dtype(dtype).itemsize, inner_chunk_bytes)
    check_readable(name, shape, outer, inner, numpy_dtype(dtype).itemsize, inner_chunk_bytes)
    return ArrayMeta(name_to_path(name), shape, dtype, outer, inner, spec, "torch", compression)


def checkpoint_meta(
    arrays: dict[str, ArrayMeta], tree: Any, layout: Layout, step: int | None, metadata: Mapping[str, Any] | None
) -> CheckpointMeta:
    """The root metadata of an imported checkpoint: every chunk of it is written."""
    return CheckpointMeta(
        arrays=arrays,
        tree=tree,
        mesh=layout.mesh,
        rules=layout.spec_rules,
        step=step,
        user_metadata=user_metadata(metadata),
        library_version=__version__,
        all_chunks_stored=True,
    )


def local_destination(path: str | os.PathLike[str], overwrite: bool, verb: str) -> Location:
    """Where an importer writes: a local directory that may take a checkpoint. Importers write
    many shards piece by piece from mapped files, which only a local directory takes in place."""
    final = locate(path)
    if not final.is_local:
        raise ValueError(
            f"{verb} writes to local directories only, not {final.url!r}; import to a local path and "
            "copy it, or load the tensors and lc.save them there"
        )
    final.check_destination(overwrite)
    return final
