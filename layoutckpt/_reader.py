"""``open``: a lazy reader for one process, no ``torch.distributed`` needed.

Opening reads one small document (the root metadata). ``read`` opens the array from that
metadata alone and fetches only the inner chunks the requested slice overlaps.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np
import tensorstore as ts

from . import _rankstate
from .base._errors import IntegrityError, TemplateMismatchError
from .base._options import IOConfig, io_config
from .engine._read import BoxRead, OnDamage, read_boxes, read_into
from .format._dtypes import numpy_dtype
from .format._format import ArrayMeta, CheckpointMeta
from .layout._index import index_box
from .layout._plan import box_shape
from .layout._spec import Mesh, P
from .layout._tree import decode_value
from .storage import _store
from .storage._location import locate
from .storage._packs import arrays_of
from .storage._readers import BoxReader
from .torch._tensors import from_numpy, to_numpy
from .torch._torch import installed, is_tensor


@attrs.frozen
class ArrayInfo:
    """How one array is stored: global shape and dtype, chunking, and the spec it was saved with.

    ``name`` is the global name asked for (a name tied to another at save time describes the
    array stored under the first name). ``shape`` is the global shape and ``dtype`` the NumPy
    dtype (``ml_dtypes`` types for bfloat16 and float8). ``shard_shape`` is the shape of one
    stored shard (the Zarr chunk, one writer's box) and ``inner_chunk_shape`` that of an inner
    chunk, the smallest unit a read fetches. ``spec`` and ``saved_mesh`` are the partition spec
    and mesh it was saved with; loading may use any other. ``kind`` is what was saved:
    ``"torch"``, ``"numpy"`` or ``"numpy_scalar"``. ``compression`` is ``"zstd"``, ``"blosc"``
    or ``None``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shard_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    spec: P
    saved_mesh: Mesh
    kind: str
    compression: str | None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole array, uncompressed: the number of elements times the item size."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def similar_names(name: str, known: list[str], n: int = 5) -> list[str]:
    """The names of ``known`` closest to ``name``: by spelling (a typo), else those that hold it
    or that it holds (a prefix forgotten or added)."""
    return difflib.get_close_matches(name, known, n=n, cutoff=0.6) or [k for k in known if name in k or k in name][:n]


class Reader:
    """Read arrays (or slices) and values of a committed checkpoint; ``open`` makes one.

    ``aliases`` maps each name tied to another at save time (shared weights) to the name its
    array is stored under; ``read`` and ``info`` accept either name.

    >>> rd = open(path)                         # doctest: +SKIP
    >>> rd.read("model.embed.weight", np.s_[0:8, :])  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str], *, io: IOConfig | None = None) -> None:
        self._root = locate(path)
        self.path = self._root.url if isinstance(path, Mapping) else os.fspath(path)
        """The path the reader was opened with (a kvstore dict's URL)."""
        self.meta: CheckpointMeta = _store.read_meta(self._root)
        """The parsed root metadata of the checkpoint."""
        self._arrays = arrays_of(self._root, self.meta)
        self._io = io_config(io)
        self._boxes: BoxReader | None = None
        self._stores: dict[str, ts.TensorStore] = {}
        self._ctx: ts.Context | None = None
        self._async: ThreadPoolExecutor | None = None
        nodes = list(self.meta.leaves.items())
        self._values = {name: node for name, node in nodes if "array" not in node}
        # Names tied at save time (shared weights) read the array stored under the first name.
        self.aliases: dict[str, str] = {n: node["array"] for n, node in nodes if node.get("array", n) != n}
        """``{name: stored name}`` for the names tied to another at save time (shared weights)."""

    def __repr__(self) -> str:
        return f"Reader({self.path!r}, step={self.step}, arrays={len(self.meta.arrays)})"

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the arrays opened so far; ``with`` calls it. A later read opens them again."""
        self._stores.clear()
        if self._boxes is not None:
            self._boxes.close()
        if self._async is not None:
            self._async.shutdown(wait=True)
            self._async = None

    @property
    def step(self) -> int | None:
        """The ``step=`` the checkpoint was saved with, or None."""
        return self.meta.step

    @property
    def metadata(self) -> dict[str, Any]:
        """The user metadata saved with the checkpoint (a copy: the parsed document is shared)."""
        return copy.deepcopy(dict(self.meta.user_metadata))

    def rank_states(self) -> list[Any]:
        """Every saved rank's ``rank_state=`` document (index = saved rank); empty if none."""
        world = self.meta.rank_state_world
        if world is None:
            return []
        return _rankstate.read_all(self._root, world)

    def keys(self) -> list[str]:
        """Global names of the stored arrays, in tree order."""
        return list(self.meta.arrays)

    def value_keys(self) -> list[str]:
        """Global names of the non-array (JSON) leaves."""
        return list(self._values)

    def __contains__(self, name: object) -> bool:
        return name in self.meta.arrays or name in self._values or name in self.aliases

    def _array(self, name: str) -> ArrayMeta:
        try:
            return self.meta.arrays[self.aliases.get(name, name)]
        except KeyError:
            if not isinstance(name, str):
                raise TypeError(f"array names are str, got {type(name).__name__} {name!r}") from None
            close = similar_names(name, [*self.meta.arrays, *self.aliases])
            hint = f"; similar names: {close}" if close else ""
            if name in self._values:
                hint = " (it is a JSON value, which read() returns)"
            raise KeyError(f"no array {name!r} in checkpoint {self.path!r}{hint}; rd.keys() lists them") from None

    def info(self, name: str) -> ArrayInfo:
        """How array ``name`` is stored (an ``ArrayInfo``), from the metadata: no data is read.

        Raises ``KeyError``, with similar names, if the checkpoint holds no such array (a JSON
        leaf is not an array: ``value_keys()`` lists those).
        """
        a = self._array(name)
        return ArrayInfo(
            name=name,
            shape=a.shape,
            dtype=numpy_dtype(a.dtype),
            shard_shape=a.shard_shape,
            inner_chunk_shape=a.inner_chunk_shape,
            spec=a.spec,
            saved_mesh=a.mesh or self.meta.mesh,
            kind=a.kind,
            compression=a.compression,
        )

    def tensorstore(self, name: str) -> ts.TensorStore:
        """The array as a TensorStore, for reads this API does not cover."""
        name = self.aliases.get(name, name)
        store = self._stores.get(name)
        if store is None:
            if self._ctx is None:
                self._ctx = _store.context(self._io.concurrency, self._io.retries)
            opened = _store.open_array(self._ctx, self._arrays, self._array(name), all_chunks_stored=self._complete)
            store = self._stores[name] = opened.result()
        return store

    @property
    def _complete(self) -> bool:
        return self.meta.all_chunks_stored

    @property
    def _reader(self) -> BoxReader:
        if self._boxes is None:
            self._boxes = self._arrays.box_reader(self.path, self._complete, self._io)
        return self._boxes

    def read(self, name: str, index: Any = ..., *, out: Any = None) -> Any:
        """The array ``name`` (or ``index`` of it, e.g. ``np.s_[0:8, :]``) as NumPy; a JSON leaf's value.

        Indexes mean what they mean to NumPy. Only the inner chunks the covering box of the index
        overlaps are read from storage (an index of arrays or booleans covers the whole array).
        ``out``, a writable NumPy array or CPU tensor of the result's shape and dtype, receives
        the result instead of a new array and is returned: a loop reading tensors of one shape
        into one buffer pays for fresh memory once.
        """
        if name in self._values:
            if out is not None or index is not Ellipsis:
                raise TemplateMismatchError(f"{name!r} is a JSON value, not an array; read it without an index or out=")
            return decode_value(self._values[name])
        stored = self.aliases.get(name, name)
        meta = self._array(stored)
        box, post = index_box(index, meta.shape, name)
        dtype = numpy_dtype(meta.dtype)
        if post is None:
            target = _out_array(out, name, box_shape(box), dtype) if out is not None else None
            (data,) = self._read_into([BoxRead(stored, meta, box, target)], stream=True)
            return out if out is not None else data
        (data,) = self._read_into([BoxRead(stored, meta, box)], stream=True)
        value = data[post]
        if out is None:
            return value
        np.copyto(_out_array(out, name, value.shape, dtype), value)
        return out

    def read_torch(self, name: str, index: Any = ..., *, out: Any = None) -> Any:
        """The array ``name`` (or ``index`` of it) as a CPU ``torch.Tensor`` of the stored dtype.

        Reads as ``read`` does, then hands the NumPy result to torch without copying it, for
        every stored dtype: bfloat16 and float8, which ``torch.from_numpy`` refuses, travel as a
        same-width integer view and are reinterpreted (only an index with a negative step, whose
        strides torch cannot take, costs one copy). ``out``, a CPU tensor, receives the result and
        is returned. A separate method, not a flag of ``read``, so that each has one return type.
        Needs PyTorch (``ImportError`` without it; ``read`` needs NumPy only).
        """
        if not installed():
            raise ImportError(
                f"Reader.read_torch({name!r}) needs PyTorch, which is not installed; install torch, "
                "or use Reader.read, which gives NumPy arrays"
            )
        if name in self._values:
            raise TypeError(f"{name!r} is a JSON value, not an array; Reader.read({name!r}) gives its value")
        if out is not None:
            if not is_tensor(out):
                raise TypeError(f"out= of read_torch({name!r}) is a {type(out).__name__}; pass a CPU tensor")
            return self.read(name, index, out=out)
        data = np.asarray(self.read(name, index))  # an integer index gives a NumPy scalar
        if any(stride < 0 for stride in data.strides):
            # Not ``ascontiguousarray``: it counts a dimension of one element as contiguous
            # whatever its stride, and returns such an array as it is.
            data = data.copy(order="C")
        return from_numpy(data, self._array(name).dtype)

    def read_many(self, items: Iterable[str | tuple[str, Any]]) -> list[np.ndarray]:
        """Several arrays (names, or ``(name, index)`` pairs) read with all their reads in flight
        together, in the order given."""
        wanted = [(item, ...) if isinstance(item, str) else tuple(item) for item in items]
        requests, posts = [], []
        for name, index in wanted:
            stored = self.aliases.get(name, name)
            meta = self._array(stored)
            box, post = index_box(index, meta.shape, name)
            requests.append(BoxRead(stored, meta, box))
            posts.append(post)
        arrays = self._read_into(requests)
        return [a if post is None else a[post] for a, post in zip(arrays, posts)]

    def _read_into(self, requests: list[BoxRead], stream: bool = False) -> list[np.ndarray]:
        """``read_into`` this checkpoint. Damage found in a checkpoint that was replaced or deleted
        since this reader opened it says so: its shards are another save's, not damaged."""
        try:
            return read_into(self._reader, requests, io=self._io, stream=stream)
        except IntegrityError as err:
            explained = _store.explain_replaced(err, self._root, self.meta.save_id)
            if explained is err:
                raise
            raise explained from err

    def read_boxes(
        self, requests: Iterable[BoxRead], *, on_damage: OnDamage | None = None
    ) -> Iterator[tuple[BoxRead, np.ndarray]]:
        """The read engine's ``read_boxes`` on this checkpoint: each request with its array, in
        order, with the reader's ``io`` bounding what is in flight. For the library's own
        readers (verify, the CLI, export, the JAX loader)."""
        return read_boxes(self._reader, requests, io=self._io, on_damage=on_damage)

    def read_async(self, name: str, index: Any = ...) -> Future[Any]:
        """A future of ``read(name, index)``: the read runs on a thread of the reader's own."""
        if self._async is None:
            self._async = ThreadPoolExecutor(1, thread_name_prefix="layoutckpt-read-async")
        return self._async.submit(self.read, name, index)


def _out_array(out: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out`` of ``Reader.read`` as the NumPy array to fill (a view of a tensor's memory),
    after checking it can hold the result."""
    if is_tensor(out):
        if out.device.type != "cpu":
            raise TemplateMismatchError(
                f"out= for {name!r} is on {out.device}; read into a CPU tensor (pinned or not) and copy it over"
            )
        out = to_numpy(out)
    if not isinstance(out, np.ndarray):
        raise TemplateMismatchError(f"out= for {name!r} is a {type(out).__name__}; pass a NumPy array or a CPU tensor")
    if out.shape != shape or out.dtype != dtype:
        raise TemplateMismatchError(
            f"out= for {name!r} is {out.dtype}{list(out.shape)}, the read gives {dtype}{list(shape)}; "
            f"pass a buffer of that shape and dtype, or read without out="
        )
    if not out.flags.writeable:
        raise TemplateMismatchError(f"out= for {name!r} is read-only; pass a writable buffer")
    return out


def open(path: str | os.PathLike[str], *, io: IOConfig | None = None) -> Reader:  # noqa: A001 - the verb of the API
    """Open a committed checkpoint for lazy reading in a single process.

    ``path`` takes every form ``save`` does: a local directory, ``file://``,
    ``s3://bucket/prefix``, ``gs://``, ``memory://``, or a TensorStore kvstore dict. Only the
    root metadata is read here; arrays are fetched by ``read``, inner chunk by inner chunk.
    ``io`` (an ``lc.IOConfig``) tunes how bytes are read: requests in flight, threads, pieces.
    Raises ``CheckpointNotFoundError`` if no committed checkpoint is at ``path``, and
    ``FormatError`` if its metadata is corrupt or of a newer format.
    """
    return Reader(path, io=io)
