"""``save``: every rank writes the boxes it was assigned, then one rank commits.

state -> flatten -> check (local, then agreed across ranks) -> plan (pure) -> write (TensorStore
futures, all in flight together) -> agree on success -> commit (root metadata last, rename).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from . import _plan, _store
from ._dist import Comm, check_mesh, comm_for, digest
from ._dtypes import zarr_name
from ._errors import CheckpointExistsError, InconsistentShardsError, SaveError
from ._format import ArrayMeta, CheckpointMeta, group_document, root_document
from ._layout import Layout
from ._spec import check_spec
from ._tensors import tensor_zarr_dtype, to_numpy
from ._tree import flatten, name_to_path
from ._version import __version__

DEFAULT_INNER_CHUNK_BYTES = 2 << 20


@attrs.frozen
class SaveResult:
    """What this rank did: the committed path, bytes it wrote, arrays it wrote, seconds taken."""

    path: str
    bytes_written: int
    arrays_written: int
    seconds: float


@attrs.frozen
class _Local:
    """One array leaf as this rank holds it."""

    name: str
    data: np.ndarray
    dtype: str
    kind: str


def _local_arrays(leaves: Mapping[str, Any]) -> list[_Local]:
    import torch

    out = []
    for name, leaf in leaves.items():
        if isinstance(leaf, torch.Tensor):
            out.append(_Local(name, to_numpy(leaf), tensor_zarr_dtype(leaf, name), "torch"))
        elif isinstance(leaf, np.ndarray):
            out.append(_Local(name, leaf, zarr_name(leaf.dtype, name), "numpy"))
        elif isinstance(leaf, np.generic):
            out.append(_Local(name, np.asarray(leaf), zarr_name(leaf.dtype, name), "numpy_scalar"))
    return out


def _agree(comm: Comm, error: BaseException | None, words: list[int]) -> tuple[list[int], list[int]]:
    """Exchange success and ``words`` in one collective; if any rank failed, all raise.

    The failing rank re-raises its own error; the others raise one that names it, so no rank is
    left waiting in a collective its peers have abandoned.
    """
    hi, lo = comm.all_max_min([1 if error else 0, *words])
    if hi[0]:
        messages = comm.all_gather_bytes(f"{type(error).__name__}: {error}".encode() if error else b"")
        if error is not None:
            raise error
        failed = [f"rank {r}: {m.decode()}" for r, m in enumerate(messages) if m]
        raise InconsistentShardsError("save refused on other ranks, nothing was written: " + "; ".join(failed))
    return hi[1:], lo[1:]


def save(
    path: str | os.PathLike[str],
    state: Any,
    layout: Layout,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    group: Any = None,
    inner_chunk_bytes: int = DEFAULT_INNER_CHUNK_BYTES,
    compression: str | None = None,
    concurrency: int = _store.DEFAULT_CONCURRENCY,
) -> SaveResult:
    """Save this rank's shards of ``state`` under ``layout``; every rank of the group calls it.

    ``state`` is a nested dict/list of local shards (``torch.Tensor`` or NumPy arrays, whose
    global shape is recovered from all ranks' local shapes) and JSON values. Returns after the
    checkpoint is committed on every rank. Bad input raises before anything is written.
    """
    t0 = time.perf_counter()
    mesh = layout.mesh
    comm = comm_for(group)
    final = Path(path).absolute()

    # 1. Local checks. An error is held until every rank has reported, so no rank hangs.
    error: BaseException | None = None
    structure: Any = None
    arrays: list[_Local] = []
    specs = []
    try:
        check_mesh(mesh, comm)
        structure, leaves = flatten(state)
        arrays = _local_arrays(leaves)
        for a in arrays:
            spec = layout.spec_for(a.name)
            check_spec(spec, mesh, a.data.ndim, a.name, a.data.shape)
            specs.append(spec)
        _check_user_metadata(metadata)
        if _store.is_committed(final) and not overwrite:
            raise CheckpointExistsError(
                f"a committed checkpoint already exists at {os.fspath(path)!r}; pass overwrite=True "
                "to replace it, or save to a new path"
            )
        if final.exists() and not _store.is_committed(final):
            # Never replace what is not ours, even with overwrite=True: a checkpoint is only ever
            # renamed into place whole, so anything else at the path belongs to someone else.
            raise CheckpointExistsError(
                f"{os.fspath(path)!r} exists and is not a committed layoutckpt checkpoint; remove it "
                "yourself or save to a new path (overwrite=True only replaces checkpoints)"
            )
    except Exception as err:  # noqa: BLE001 - re-raised by _agree on every rank
        error = err
    # The mesh is part of each spec: ranks that order or size the mesh axes differently would
    # place their shards at different boxes.
    signature = [(a.name, a.dtype, a.data.ndim, f"{s!r} on {mesh!r}") for a, s in zip(arrays, specs)]
    hi, lo = _agree(comm, error, [*digest((signature, structure)), sum(a.data.ndim for a in arrays)])
    if hi != lo:
        raise InconsistentShardsError(_describe_disagreement(comm, signature))

    # 2. Global shapes from every rank's local shapes, then this rank's shards are checked.
    local_dims = [d for a in arrays for d in a.data.shape]
    sums = comm.all_reduce(local_dims, "sum")
    maxs, mins = comm.all_max_min(local_dims)
    metas: dict[str, ArrayMeta] = {}
    plan_arrays: list[_plan.ArraySpec] = []
    offset = 0
    for a, spec in zip(arrays, specs):
        sl = slice(offset, offset + a.data.ndim)
        offset += a.data.ndim
        shape = _plan.global_shape_from_sums(a.name, spec, mesh, sums[sl], mins[sl], maxs[sl])
        outer = _plan.shard_shape(shape, spec, mesh)
        itemsize = a.data.dtype.itemsize
        metas[a.name] = ArrayMeta(
            path=name_to_path(a.name),
            shape=shape,
            dtype=a.dtype,
            shard_shape=outer,
            inner_chunk_shape=_plan.inner_chunk_shape(outer, itemsize, inner_chunk_bytes),
            spec=spec,
            kind=a.kind,
            compression=compression,
        )
        plan_arrays.append(_plan.ArraySpec(a.name, shape, spec, itemsize))
    error = None
    try:
        for a, pa in zip(arrays, plan_arrays):
            expected = _plan.box_shape(_plan.shard_box(pa.shape, pa.spec, mesh, comm.rank))
            if tuple(a.data.shape) != expected:
                raise InconsistentShardsError(
                    f"array {a.name!r}: rank {comm.rank} holds a shard of shape {tuple(a.data.shape)}, but "
                    f"the global shape {pa.shape} recovered from all ranks, split by {pa.spec!r} on "
                    f"{mesh!r} (as torch.chunk would), gives this rank {expected}; check that every "
                    "rank passes its own shard of the same tensor"
                )
    except InconsistentShardsError as err:
        error = err
    _agree(comm, error, [])

    # 3. Write: the temporary directory's name comes from rank 0, every rank writes its boxes.
    tmp = Path(comm.broadcast_bytes(str(_store.temp_dir_for(final)).encode() if comm.rank == 0 else None).decode())
    meta = CheckpointMeta(
        arrays=metas,
        tree=structure,
        mesh=mesh,
        rules=layout.rules,
        step=step,
        user_metadata=dict(metadata or {}),
        library_version=__version__,
    )
    written = 0
    count = 0
    failure = b""
    try:
        if comm.rank == 0:
            _write_skeleton(tmp, meta)
        ctx = _store.context(concurrency)
        mine = _plan.writes_of(plan_arrays, mesh, comm.rank)
        opened = {i: _store.open_array(ctx, tmp, metas[arrays[i].name]) for i, _ in mine}
        futures = []
        for i, box in mine:
            store = opened[i].result()
            target = store[tuple(slice(a, b) for a, b in box)] if box else store
            futures.append(target.write(arrays[i].data, can_reference_source_data_indefinitely=True))
            written += arrays[i].data.nbytes
            count += 1
        for f in futures:
            f.result()
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        failure = f"{type(err).__name__}: {err}".encode()
    _commit(comm, tmp, final, meta, failure, overwrite)
    return SaveResult(os.fspath(final), written, count, time.perf_counter() - t0)


def _check_user_metadata(metadata: Mapping[str, Any] | None) -> None:
    """User metadata is stored as strict JSON in the commit marker: check it before writing."""
    import json

    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata= must be a dict of JSON values, got {type(metadata).__name__}")
    for key, value in metadata.items():
        try:
            json.dumps({key: value}, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"metadata[{key!r}] cannot be stored as JSON ({err}); use str/int/float/bool/None, "
                "lists and dicts of them, with finite floats"
            ) from None
        if not isinstance(key, str):
            raise TypeError(f"metadata key {key!r} must be a str")


def _write_skeleton(tmp: Path, meta: CheckpointMeta) -> None:
    """The Zarr metadata of every group and array, so plain ``zarr`` can walk the hierarchy."""
    import json

    # Other ranks' TensorStore writes may already have created it.
    tmp.mkdir(parents=True, exist_ok=True)
    groups: set[str] = set()
    for a in meta.arrays.values():
        parts = a.path.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
        _store.write_file(tmp / a.path / "zarr.json", json.dumps(a.zarr_metadata()).encode())
    for g in groups:
        _store.write_file(tmp / g / "zarr.json", group_document())


def _commit(comm: Comm, tmp: Path, final: Path, meta: CheckpointMeta, failure: bytes, overwrite: bool) -> None:
    """Commit only if every rank wrote all it had to; otherwise remove the partial data."""
    (failed,) = comm.all_reduce([1 if failure else 0], "max")
    if failed:
        messages = comm.all_gather_bytes(failure)
        if comm.rank == 0:
            _store.remove_tree(tmp)
        comm.barrier()
        detail = "; ".join(f"rank {r}: {m.decode()}" for r, m in enumerate(messages) if m)
        raise SaveError(f"saving {os.fspath(final)!r} failed, nothing was committed: {detail}")
    status = b""
    if comm.rank == 0:
        try:
            _store.fsync_tree(tmp)
            _store.write_file(tmp / "zarr.json", root_document(meta))
            _store.commit_dir(tmp, final, overwrite=overwrite)
        except Exception as err:  # noqa: BLE001 - broadcast to every rank below
            _store.remove_tree(tmp)
            status = f"{type(err).__name__}: {err}".encode()
    status = comm.broadcast_bytes(status if comm.rank == 0 else None)
    if status:
        raise SaveError(f"committing {os.fspath(final)!r} failed on rank 0: {status.decode()}")


def _describe_disagreement(comm: Comm, signature: list[Any]) -> str:
    mine = repr(signature).encode()
    everyone = comm.all_gather_bytes(mine)
    differing = [r for r, s in enumerate(everyone) if s != everyone[0]]
    if not differing:
        return "ranks hold the same arrays but different JSON values or tree structure; non-tensor leaves must be equal on every rank"
    r = differing[0]
    first = dict((n, (d, k, s)) for n, d, k, s in eval_signature(everyone[0]))
    other = dict((n, (d, k, s)) for n, d, k, s in eval_signature(everyone[r]))
    only0 = sorted(set(first) - set(other))[:3]
    onlyr = sorted(set(other) - set(first))[:3]
    changed = [n for n in first if n in other and first[n] != other[n]][:3]
    parts = []
    if only0:
        parts.append(f"arrays only on rank 0: {only0}")
    if onlyr:
        parts.append(f"arrays only on rank {r}: {onlyr}")
    for n in changed:
        parts.append(f"array {n!r} is (dtype, ndim, spec) {first[n]} on rank 0 but {other[n]} on rank {r}")
    return (
        "ranks disagree about the state to save: "
        + "; ".join(parts)
        + "; every rank must pass the same names, dtypes and ranks, and the same layout"
    )


def eval_signature(raw: bytes) -> list[tuple[str, str, int, str]]:
    import ast

    return [tuple(x) for x in ast.literal_eval(raw.decode())]
