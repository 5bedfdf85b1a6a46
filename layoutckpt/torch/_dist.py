"""The few collectives a save needs, on small integer tensors (no pickled objects).

Every rank plans alone; the collectives only check that the ranks agree (a digest of names and
dtypes, the sums and extremes of local shapes), share the temporary directory's name, and
agree on success before the commit. Each returns only once gloo's worker threads hold none of
its tensors (``_let_go``), so a process may end right after one.

A collective that fails because a rank left the world raises ``RankLostError`` naming that rank,
where the backend's own error names only a network address: the ranks still alive answer a roll
call in the job's key-value store (``_roll_call``), and the ones that do not answer are named.
That costs nothing while every collective succeeds.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import attrs

from ..base._errors import RankLostError, SaveError, WorldSizeError, same_kind
from ..layout._spec import Mesh
from ._torch import dist, distributed, torch

# The longest a collective waits for gloo's worker to let go of its tensors: the worker drops a
# finished work at once, or a few milliseconds later on busy cores, and a collective must not
# hang on a torch whose gloo keeps its works longer.
LET_GO_SECONDS = 2.0

# The first byte of a published exchange: the combined data follows, or a failure naming a rank.
_DONE, _FAILED = b"+", b"!"

# How long a rank whose collective failed waits for the others to answer the roll call. Ranks
# blocked in the same collective learn of a lost peer within milliseconds of each other and
# answer at once; only a rank that is gone (or stuck elsewhere) makes the call last this long.
ROLL_CALL_SECONDS = 3.0

# Roll calls this process took part in, by process group: the ranks of a group fail their
# collectives in the same order, so the n-th roll call of each rank is the same one. Weak, so
# that a group made anew (a new world in this process) starts again from the first.
_ROLL_CALLS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_ROLL_CALLS_LOCK = threading.Lock()


@attrs.frozen
class Comm:
    rank: int
    world: int
    group: Any = None
    # Whether a failed collective holds a roll call to name the ranks lost (``lost``), or
    # raises the backend's error as it is (for a caller that needs no names: ``unnamed``).
    roll_call: bool = True
    # When a rank that leaves is said to have left, in the error that names it (``during``).
    when: str = "in the middle of a collective"

    def during(self, when: str) -> Comm:
        """This comm, whose errors say that a lost rank left the world ``when``."""
        return attrs.evolve(self, when=when)

    def unnamed(self) -> Comm:
        """This comm, whose failed collectives raise the backend's error at once."""
        return attrs.evolve(self, roll_call=False)

    @property
    def global_ranks(self) -> list[int]:
        """The global rank of each rank of the group, in group order."""
        if not distributed():
            return [0]
        if self.group is None:
            return list(range(self.world))
        return list(dist.get_process_group_ranks(self.group))

    @property
    def device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def all_reduce(self, values: Sequence[int], op: str) -> list[int]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        with self._collective("all_reduce"):
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.group)
        self._let_go(t)
        return t.tolist()

    def all_max_min(self, values: Sequence[int]) -> tuple[list[int], list[int]]:
        both = self.all_reduce([*values, *(-v for v in values)], "max")
        n = len(values)
        return both[:n], [-v for v in both[n:]]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank."""
        if self.world == 1:
            assert data is not None
            return data
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        with self._collective("broadcast"):
            dist.broadcast(size, group=self.group, group_src=0)
        self._let_go(size)
        if int(size.item()) == 0:
            return b""
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            assert data is not None
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        with self._collective("broadcast"):
            dist.broadcast(buf, group=self.group, group_src=0)
        self._let_go(buf)
        return bytes(buf.cpu().numpy().tobytes())

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        if self.world == 1:
            return [data]
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        with self._collective("all_gather"):
            dist.all_gather(sizes, length, group=self.group)
        self._let_go(length, *sizes)
        longest = max(1, max(int(s.item()) for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.zeros(longest, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
        with self._collective("all_gather"):
            dist.all_gather(bufs, mine, group=self.group)
        self._let_go(mine, *bufs)
        return [bytes(b.cpu().numpy()[: int(s.item())].tobytes()) for b, s in zip(bufs, sizes)]

    def all_reduce_tensor(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the group, in place."""
        if self.world > 1:
            with self._collective("all_reduce"):
                dist.all_reduce(t, group=self.group)
            self._let_go(t)

    def broadcast_many(self, sources: Sequence[int], data: bytes | None) -> list[bytes]:
        """What each rank of ``sources`` passes as ``data`` (others pass None), on every rank:
        one all-reduce of the lengths, then one broadcast per source, whatever the world size."""
        if self.world == 1:
            return [data or b""] * len(sources)
        lengths = self.all_reduce([len(data or b"") if self.rank == r else 0 for r in sources], "max")
        out = []
        for src, n in zip(sources, lengths):
            if n == 0:
                out.append(b"")
                continue
            buf = torch.zeros(n, dtype=torch.uint8, device=self.device)
            if self.rank == src:
                buf.copy_(torch.frombuffer(bytearray(data or b""), dtype=torch.uint8))
            with self._collective("broadcast"):
                dist.broadcast(buf, group=self.group, group_src=src)
            self._let_go(buf)
            out.append(bytes(buf.cpu().numpy().tobytes()))
        return out

    def barrier(self) -> None:
        if self.world > 1:
            self.all_reduce([0], "max")

    def finish(self) -> None:
        """Nothing to do: a collective returns on every rank only once all took part."""

    def exchange(
        self, sends: Sequence[tuple[int, int, torch.Tensor]], recvs: Sequence[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Point to point: send each (to, tag, tensor), receive into each (from, tag, tensor).

        Both sides know every message's size from the plan, so no sizes travel. Tensors go as
        bytes (a contiguous 1-D tensor of any dtype). One on a device the group does not carry
        point to point (a GPU's under gloo, host memory under NCCL) travels as a copy on one it
        does, and what arrives in such a copy is copied into its tensor.
        """
        if not sends and not recvs:
            return
        carried = carriers(str(dist.get_backend(self.group)))
        out = [self._on_carrier(_as_bytes(t), carried, copy=True) for _, _, t in sends]
        into = [_as_bytes(t) for _, _, t in recvs]
        staged = [self._on_carrier(t, carried, copy=False) for t in into]
        ops = [dist.P2POp(dist.isend, t, self._global(to), self.group, tag) for (to, tag, _), t in zip(sends, out)]
        ops += [
            dist.P2POp(dist.irecv, t, self._global(src), self.group, tag) for (src, tag, _), t in zip(recvs, staged)
        ]
        with self._collective("exchange"):
            works = dist.batch_isend_irecv(ops)
            while works:
                works.pop().wait()
        for t, s in zip(into, staged):
            if s is not t:
                t.copy_(s)
        self._let_go(*(op.tensor for op in ops))

    def _on_carrier(self, t: torch.Tensor, carried: frozenset[str] | None, copy: bool) -> torch.Tensor:
        """``t`` where the group carries its device point to point; else a tensor like it in
        host memory or on the group's device, which the group does carry, holding ``t``'s data
        where ``copy``."""
        if carried is None or t.device.type in carried:
            return t
        device = torch.device("cpu") if "cpu" in carried else self.device
        return t.to(device) if copy else torch.empty_like(t, device=device)

    @contextlib.contextmanager
    def _collective(self, name: str) -> Iterator[None]:
        """Run collective ``name``; should the backend fail it, raise what ``lost`` makes of that."""
        try:
            yield
        except RuntimeError as err:
            if not self.roll_call or isinstance(err, (SaveError, torch.OutOfMemoryError)):
                raise  # named already (an inner collective), this rank's own, or no names wanted
            raise_named(self, err, name)

    def lost(self, err: BaseException, name: str) -> BaseException:
        """What to raise for ``err``, the backend's failure of collective ``name``: a
        ``RankLostError`` naming the ranks that do not answer a roll call in the job's
        key-value store within ``ROLL_CALL_SECONDS``, or ``err`` itself where every rank
        answers (then the collective failed for another reason, alike everywhere)."""
        if self.world == 1 or not distributed():
            return err
        store = dist.distributed_c10d._get_default_store()
        try:
            missing = _roll_call(store, self._roll_prefix(), self.rank, self.world, ROLL_CALL_SECONDS)
        except Exception as gone:  # noqa: BLE001 - the store went with its host
            return self._store_lost(err, name, store, gone)
        if not missing:
            return err
        who = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
        return RankLostError(
            f"{who}{self._globally(missing)} left the world {self.when}: the {name} of rank {self.rank} "
            f"over the process group failed ({_brief(err)}), and {who} did not answer a roll call in the job's "
            f"key-value store within {ROLL_CALL_SECONDS:g} s, so {'it has' if len(missing) == 1 else 'they have'} "
            f"died, or hangs apart from the others. {_RESTART}",
            missing,
        )

    def _store_lost(self, err: BaseException, name: str, store: Any, gone: BaseException) -> RankLostError:
        """The error for a failed collective when the job's store is unreachable too: rank 0
        is named when it hosts the store, which a rank that ends takes with it."""
        why = (
            f"the {name} of rank {self.rank} over the process group failed ({_brief(err)}), and the job's "
            f"key-value store is unreachable ({_brief(gone)})"
        )
        host = self.global_ranks.index(0) if _rank0_hosts(store) and 0 in self.global_ranks else None
        if host is None or host == self.rank:
            return RankLostError(
                f"a rank left the world {self.when}, and which one cannot be learnt: {why}. {_RESTART}", []
            )
        return RankLostError(
            f"rank {host}{self._globally([host])} (which hosts the job's key-value store) left the world "
            f"{self.when}: {why}. {_RESTART}",
            [host],
        )

    def _roll_prefix(self) -> str:
        """The store keys of this group's next roll call, the same on every rank of it."""
        group = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
        with _ROLL_CALLS_LOCK:
            n = _ROLL_CALLS[group] = _ROLL_CALLS.get(group, 0) + 1
        name = getattr(group, "group_name", "") or ",".join(map(str, self.global_ranks))
        return f"layoutckpt/roll-call/{name}/{n}"

    def _globally(self, ranks: list[int]) -> str:
        """`` (global rank ...)`` where the group's ranks are not the job's, else nothing."""
        everyone = self.global_ranks
        if everyone == list(range(len(everyone))):
            return ""
        return " (global " + ", ".join(str(everyone[r]) for r in ranks) + ")"

    def _let_go(self, *tensors: torch.Tensor) -> None:
        """Return once no thread but this one holds ``tensors``, the tensors of a finished collective.

        gloo's ``wait()`` returns as soon as the result is in; the worker thread that ran the
        collective drops its work, and with it the work's references to the tensors, a moment
        later (``ProcessGroupGloo::runLoop``). A tensor whose Python object is gone by then is
        freed on that thread, which takes the GIL to do it. Should the interpreter have begun
        shutting down, as when the caller's last step was this collective, the thread is stopped
        inside C++ and the process aborts ("terminate called without an active exception").
        Held here until the worker has let go, the tensors are freed on the calling thread.
        """
        if not tensors or tensors[0].device.type != "cpu" or "gloo" not in str(dist.get_backend(self.group)):
            return  # other backends keep their works longer (NCCL's watchdog); not waited for
        deadline = time.monotonic() + LET_GO_SECONDS
        for t in tensors:
            while t._use_count() > 1 and time.monotonic() < deadline:
                time.sleep(0.0001)  # the worker needs a core, not the GIL, to drop its work

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


_RESTART = (
    "Restart the job on every rank from the last committed checkpoint; a save interrupted so commits "
    "nothing, and leaves the checkpoints committed before it intact"
)


@attrs.frozen
class Failure:
    """One rank's failure, as ``fail_together`` tells it to the others."""

    rank: int
    kind: str  # the exception's class name
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


def fail_together(
    comm: Comm,
    error: BaseException | None,
    elsewhere: Callable[[list[Failure]], BaseException],
    words: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """Tell every rank whether this one failed, with ``words`` (each one's maximum and minimum
    over the ranks come back), in one collective. Where any rank failed, every rank raises: the
    failing ones their own error, the others ``elsewhere(failures)``, so that no rank goes on
    alone into a collective its peers have left."""
    hi, lo = comm.all_max_min([1 if error else 0, *words])
    if not hi[0]:
        return hi[1:], lo[1:]
    told = comm.all_gather_bytes(f"{type(error).__name__}\0{error}".encode() if error else b"")
    if error is not None:
        raise error
    failures = [Failure(r, *m.decode().split("\0", 1)) for r, m in enumerate(told) if m]
    raise elsewhere(failures)


def told(preface: str, kind: type[Exception] | None = None) -> Callable[[list[Failure]], Exception]:
    """The error a rank raises for its peers' failures (``fail_together``'s ``elsewhere``):
    ``preface``, then each failure, as ``kind``, else as the failures' one class where that is
    a plain one (``same_kind``)."""

    def made(failures: list[Failure]) -> Exception:
        cls = kind if kind is not None else same_kind(f.kind for f in failures)
        return cls(f"{preface}: " + "; ".join(map(str, failures)))

    return made


@contextlib.contextmanager
def failing_together(comm: Comm, elsewhere: Callable[[list[Failure]], BaseException], *, when: bool) -> Iterator[None]:
    """Run the block, then, ``when`` so, ``fail_together``: where it failed on any rank, every
    rank raises, before anything the block prepared goes further."""
    try:
        yield
    except Exception as err:
        if when:
            fail_together(comm, err, elsewhere)
        raise
    if when:
        fail_together(comm, None, elsewhere)


def raise_named(comm: Comm | StoreComm, err: BaseException, name: str) -> NoReturn:
    """Raise ``comm``'s error for ``err``, the failure of its collective ``name``: the ranks lost
    named where ``comm`` can learn them, with ``err`` as the cause; else ``err`` as it is."""
    named = comm.lost(err, name)
    if named is err:
        raise err
    raise named from err


def _roll_call(store: Any, prefix: str, rank: int, world: int, seconds: float) -> list[int]:
    """Answer the roll call under ``prefix`` and wait up to ``seconds`` for the other ranks to
    answer; the ranks that do not. One store operation per poll while waiting (all keys at
    once), then one per rank, once, to learn which are missing; any store error propagates."""
    store.set(f"{prefix}/{rank}", b"")
    others = {r: f"{prefix}/{r}" for r in range(world) if r != rank}
    deadline = time.monotonic() + seconds
    pause = 0.005
    while not store.check(list(others.values())):
        if time.monotonic() >= deadline:
            return [r for r, key in others.items() if not store.check([key])]
        time.sleep(pause)
        pause = min(0.1, 2 * pause)
    return []


def _rank0_hosts(store: Any) -> bool:
    """Whether the job's store lives in global rank 0's process: a ``TCPStore`` made by
    ``init_process_group`` (``tcp://``, ``env://``), unless torchrun's agent hosts it."""
    while hasattr(store, "underlying_store"):  # PrefixStores, one per layer of keys
        store = store.underlying_store
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return isinstance(store, dist.TCPStore) and not agent


def _brief(err: BaseException) -> str:
    """``Type: first line`` of ``err``, without the source location gloo puts first."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return f"{type(err).__name__}: {text.split('. ', 1)[0]}"


# The device type whose tensors each backend sends point to point. gloo hands a tensor's
# address to its transport as host memory whatever the device (it registers for CUDA too, for
# its collectives), and NCCL sends device memory only.
_POINT_TO_POINT = {"gloo": "cpu", "nccl": "cuda", "mpi": "cpu"}


def carriers(backend: str) -> frozenset[str] | None:
    """The device types whose tensors a group of ``backend`` sends point to point:
    ``"gloo"`` -> cpu, ``"nccl"`` -> cuda, ``"cpu:gloo,cuda:nccl"`` -> both; None where a
    backend is not known here, whose tensors then go as they are."""
    pairs = [p.split(":", 1) if ":" in p else [_POINT_TO_POINT.get(p, ""), p] for p in backend.split(",")]
    if any(name not in _POINT_TO_POINT for _, name in pairs):
        return None
    return frozenset(dev for dev, name in pairs if _POINT_TO_POINT[name] == dev)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.numel() else t.reshape(0).view(torch.uint8)


def comm_for(group: Any = None) -> Comm:
    """This process's place: the default process group (or ``group``), else a world of one."""
    if distributed():
        return Comm(dist.get_rank(group), dist.get_world_size(group), group)
    if group is not None:
        raise WorldSizeError("a process group was passed but torch.distributed is not initialized")
    return Comm(0, 1, None)


class StoreComm:
    """The commit's few collectives over the job's key-value store, for a background thread.

    An async save commits on its own thread while the training loop keeps issuing collectives
    on its process groups; two threads on one group would interleave their collectives, and a
    new group per save would be a collective of its own. The rendezvous store that
    ``init_process_group`` made serves every group, is safe from any thread, and keys under the
    save's unique temporary name keep concurrent saves of different groups apart. Each step is
    gather-to-rank-0 and publish: O(ranks) store operations, not O(ranks squared).

    Every wait has a deadline. Rank 0 waits ``timeout`` seconds for the others, then publishes
    a failure naming the ranks that did not report, so every rank still alive raises the same
    error; the others wait twice as long for rank 0, whose verdict on a missing peer thus comes
    first. ``finish`` holds rank 0 until every rank has read the last exchange: rank 0 may host
    the store (``env://``), and a process that ends takes the store with it.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world: int, timeout: float) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self._step = 0

    def _exchange(self, data: bytes, combine: Any) -> bytes:
        self._step += 1
        key = f"{self.prefix}/{self._step}"
        if self.rank != 0:
            self.store.set(f"{key}/{self.rank}", data)
            return self._published(f"{key}/all")
        peers = {f"{key}/{r}": r for r in range(1, self.world)}
        try:
            self._wait(list(peers), self.timeout, "")
        except SaveError as err:
            try:  # every rank still alive learns who is missing, at once
                self.store.set(f"{key}/all", _FAILED + str(err).encode())
            except Exception:  # noqa: BLE001 - the error names the missing rank either way
                pass
            raise
        parts = [data]
        for k in peers:
            parts.append(bytes(self.store.get(k)))
            self.store.delete_key(k)
        out = combine(parts)
        self._publish(f"{key}/all", out)
        return out

    def _publish(self, key: str, out: bytes) -> None:
        """Rank 0's result under ``key``, unless a rank that gave up waiting for it has claimed
        the key first with its failure (``_published``): then that failure, on every rank."""
        got = bytes(self.store.compare_set(key, "", _DONE + out))
        if got[:1] == _FAILED:
            raise SaveError(got[1:].decode())

    def _published(self, key: str) -> bytes:
        """What rank 0 published under ``key``; its failure raised. A rank that waits in vain
        claims the key with its own failure, atomically: rank 0, slow but alive, then finds it
        there and fails too, rather than commit a save its peers have given up on; where rank 0
        published first, its result stands."""
        try:
            self._wait([key], 2 * self.timeout, "rank 0")
            out = bytes(self.store.get(key))
        except SaveError as err:
            try:
                out = bytes(self.store.compare_set(key, "", _FAILED + str(err).encode()))
            except Exception:  # noqa: BLE001 - the store is gone: nobody can commit now
                raise err from None
        if out[:1] == _FAILED:
            raise SaveError(out[1:].decode())
        return out[1:]

    def _wait(self, keys: list[str], seconds: float, whom: str) -> None:
        """Until every key of ``keys`` is set; ``SaveError`` naming the ranks missing after
        ``seconds`` (``whom``, or the ranks whose keys are absent), or an unreachable store."""
        try:
            self.store.wait(keys, datetime.timedelta(seconds=seconds))
            return
        except Exception as err:  # noqa: BLE001 - a timeout and a lost store look alike here
            cause = err
        try:
            missing = [k for k in keys if not self.store.check([k])]
        except Exception as err:  # noqa: BLE001 - the store itself is gone
            raise SaveError(
                f"rank {self.rank} lost the job's key-value store while waiting for {whom or 'the other ranks'} "
                f"({type(err).__name__}: {err}); the store's host (rank 0 under env://) has ended or crashed, "
                "so this rank cannot learn the outcome of the save"
            ) from cause
        if not missing:
            return
        names = whom or "rank " + ", ".join(k.rsplit("/", 1)[1] for k in missing)
        raise SaveError(
            f"rank {self.rank} waited {seconds:g} s for {names} to report during the commit of a "
            f"save_async, in vain: {names} has died or is stuck. "
            "Pass a larger timeout= if a rank may legitimately take longer to write its shards"
        ) from cause

    def all_reduce(self, values: Sequence[int], op: str) -> list[int]:
        reduce = {"sum": sum, "max": max}[op]

        def combine(parts: list[bytes]) -> bytes:
            rows = [json.loads(p) for p in parts]
            return json.dumps([reduce(col) for col in zip(*rows)]).encode()

        return json.loads(self._exchange(json.dumps(list(values)).encode(), combine))

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        def combine(parts: list[bytes]) -> bytes:
            return json.dumps([p.hex() for p in parts]).encode()

        return [bytes.fromhex(h) for h in json.loads(self._exchange(data, combine))]

    def during(self, when: str) -> StoreComm:
        """Itself: its errors name the ranks that did not report already."""
        return self

    def unnamed(self) -> StoreComm:
        return self

    def lost(self, err: BaseException, name: str) -> BaseException:
        """``err`` itself: a failed exchange names the missing ranks already."""
        return err

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank; rank 0 waits for nobody here (``finish`` waits)."""
        self._step += 1
        key = f"{self.prefix}/{self._step}/all"
        if self.rank != 0:
            return self._published(key)
        self._publish(key, data or b"")
        return data or b""

    def barrier(self) -> None:
        self._exchange(b"", lambda parts: b"")

    def finish(self) -> None:
        """After the last exchange of a save: rank 0 returns once every rank has read it, then
        deletes the save's keys; a rank gone by then changes nothing (the outcome is decided)."""
        acks = [f"{self.prefix}/ack/{r}" for r in range(1, self.world)]
        try:
            if self.rank != 0:
                self.store.set(f"{self.prefix}/ack/{self.rank}", b"")
                return
            self.store.wait(acks, datetime.timedelta(seconds=self.timeout))
            for k in [*acks, *(f"{self.prefix}/{s}/all" for s in range(1, self._step + 1))]:
                self.store.delete_key(k)
        except Exception:  # noqa: BLE001 - see the docstring
            pass


def background_comm(comm: Comm, key: str, timeout: float) -> Comm | StoreComm:
    """Collectives for the commit of the save named ``key``, safe on a background thread; each
    wait for another rank ends after ``timeout`` seconds (see ``StoreComm``)."""
    if comm.world == 1:
        return comm
    store = dist.distributed_c10d._get_default_store()
    return StoreComm(store, f"layoutckpt/{key}", comm.rank, comm.world, timeout)


def check_mesh(mesh: Mesh, comm: Comm) -> None:
    if mesh.size != comm.world:
        raise WorldSizeError(
            f"{mesh!r} has {mesh.size} devices but the process group has {comm.world} ranks; "
            f"declare a mesh whose axis sizes multiply to {comm.world}"
        )


def digest(items: object) -> list[int]:
    """Two int64 words of a SHA-256 of ``repr(items)``: equal on every rank iff the ranks agree."""
    h = hashlib.sha256(repr(items).encode()).digest()
    return [int.from_bytes(h[:7], "little"), int.from_bytes(h[7:14], "little")]
