"""A ``memory://`` fast tier holds each piece as the host arrays the save copied the state into
(``storage._held``): restores copy boxes straight out of them, bit for bit, through the held
reader (never TensorStore); the buffers go back to the tier's pool when a piece is retired and
the next saves reuse them; a piece that is gone or damaged falls back to the durable tier; and
``lc.open``, ``lc.load`` and ``mgr.reader()`` read a held piece by its URL. Other ``memory://``
URLs stay TensorStore's memory store.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import uuid

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt.base import _faults
from layoutckpt.base._options import DEFAULT_IO
from layoutckpt.engine._read import BoxRead, read_into
from layoutckpt.storage import _held, _store
from layoutckpt.storage._location import KvPrefix, locate
from layoutckpt.storage._readers import TensorStoreReader
from tests.support.storage_suite import LocationTests


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {
        "w": torch.randn(64, 48, generator=g),
        "e": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "n": np.arange(12, dtype=np.int32).reshape(3, 4) * step,
        "empty": torch.zeros(0, 3),
        "step": step,
    }


def assert_state(out: dict, step: int) -> None:
    want = state(step)
    assert out["step"] == step
    for k in ("w", "e", "empty"):
        assert out[k].dtype == want[k].dtype and out[k].shape == want[k].shape, k
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k
    assert np.array_equal(out["n"], want["n"]) and out["n"].dtype == want["n"].dtype


def memory_url() -> str:
    return f"memory://held-{uuid.uuid4().hex[:8]}/{{rank}}"


@pytest.fixture
def no_tensorstore_reads(monkeypatch):
    """Any read through TensorStore fails: a restore that passes went through the held reader."""

    def refuse(*_a, **_k):
        raise AssertionError("a held piece was read through TensorStore")

    monkeypatch.setattr(TensorStoreReader, "start", refuse)
    monkeypatch.setattr(TensorStoreReader, "read", refuse)


def steady_saves(mgr: lc.CheckpointManager, steps: range) -> set[int]:
    """Save ``steps`` one after the other (each committed before the next); the addresses of
    every host buffer the tier's pool handed out meanwhile."""
    mgr.save(steps[0], state(steps[0]), lc.Layout.replicated()).result()  # makes the pool
    pool = mgr._tiers._pool(False)
    seen: set[int] = set()
    acquire = pool.acquire

    def recording(nbytes: int):
        buf = acquire(nbytes)
        seen.add(buf.data_ptr())
        return buf

    pool.acquire = recording
    for step in steps[1:]:
        mgr.save(step, state(step), lc.Layout.replicated()).result()
    return seen


# --- one process -----------------------------------------------------------------------------------


def test_a_memory_tier_restores_bit_exact_through_the_held_reader(tmp_path, no_tensorstore_reads):
    local = memory_url()
    layout = lc.Layout.replicated()
    with lc.CheckpointManager(tmp_path / "d", local=local, persist_every=100) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step), layout, metadata={"at": step}, rank_state={"pos": step}).result()
        url = mgr._tiers.tier.piece(3).url
        assert isinstance(locate(url), _held.HeldPrefix) and locate(url).committed()
        assert_state(mgr.load(layout), 3)
        assert mgr.tier_metrics().restored_from == "local"
        assert mgr.load_rank_state() == {"pos": 3} and mgr.metadata() == {"at": 3}
        assert_state(mgr.load(layout, step=2), 2)
    # A later manager in the same process restores what the first one held.
    with lc.CheckpointManager(tmp_path / "d", local=local, persist_every=100) as mgr:
        assert mgr.latest_step() == 3 and mgr.local_steps() == [2, 3]
        assert_state(mgr.load(layout), 3)


def test_a_held_piece_is_the_staged_host_copy_itself(tmp_path):
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), persist_every=100) as mgr:
        seen = steady_saves(mgr, range(1, 4))
        piece = locate(mgr._tiers.tier.piece(3).url)
        meta = lc.open(piece.url).meta.arrays
        for name in ("w", "e", "n"):
            held = piece.array(meta[name]).data
            assert held.ctypes.data in seen, name  # kept as the pool's buffer: no copy


def test_buffers_go_back_at_retirement_and_the_next_saves_reuse_them(tmp_path):
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), local_keep_last=2, persist_every=100) as mgr:
        seen = steady_saves(mgr, range(1, 41))
        pool = mgr._tiers._pool(False)
        one_set = sum(a.nbytes for k, a in state(0).items() if k in ("w", "n")) + state(0)["e"].nbytes
        # Two pieces held and one being saved: three sets of buffers, however many saves.
        assert len(seen) <= 3 * 3
        assert pool.held_bytes <= 3 * one_set
        assert mgr.local_steps() == [39, 40]


def test_steady_saves_make_no_new_objects_that_live_as_long_as_a_piece(tmp_path, monkeypatch):
    """A piece lives for several steps, so every object made for it per save is one the garbage
    collector promotes to its oldest generation (full collections walk the whole process). Once
    the pool's buffers exist, a save of the same state reuses their views and its structure."""
    from layoutckpt.tiers import _saver

    pieces = {}
    write = _saver.write_piece

    def recording(final, piece, *args, **kwargs):
        pieces[piece.meta.step] = piece
        return write(final, piece, *args, **kwargs)

    monkeypatch.setattr(_saver, "write_piece", recording)
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), local_keep_last=2, persist_every=100) as mgr:
        for step in range(1, 10):
            mgr.save(step, state(1), lc.Layout.replicated()).result()

        def views(steps: range) -> set[int]:  # NumPy arrays are no garbage collector's concern
            return {id(a) for s in steps for a in pieces[s].arrays.values() if torch.is_tensor(a) and a.numel()}

        assert len(views(range(4, 7))) == 3 * 2 and views(range(7, 10)) <= views(
            range(4, 7)
        )  # the same tensor objects: the pool's views of its buffers
        assert all(pieces[step].meta.tree is pieces[4].meta.tree for step in range(5, 10))


def test_a_save_leaves_few_objects_per_array_that_outlive_the_next_save(tmp_path):
    """What a piece keeps per array is what the garbage collector promotes every step: the held
    array, not a new tensor behind each NumPy view of a buffer (torch's ``numpy()`` makes one per
    call), nor a new view of a buffer, nor a loan apart from the array."""
    many = {f"w{i}": torch.randn(8, 8) for i in range(100)}
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), local_keep_last=2, persist_every=1000) as mgr:
        for step in range(1, 8):
            mgr.save(step, many).result()
        kept = []
        for step in range(8, 20, 2):
            gc.collect()
            before = {id(o) for o in gc.get_objects()}
            mgr.save(step, many).result()
            mgr.save(step + 1, many).result()
            gc.collect()
            kept.append(sum(id(o) not in before for o in gc.get_objects()) / 2 / len(many))
    # About 1.15: the held array. 2.3 with a new tensor behind each NumPy view and a loan apart.
    assert statistics.median(kept) < 1.7, kept


def test_a_tier_slower_than_the_loop_holds_up_the_loop_not_more_buffers(tmp_path, monkeypatch):
    from layoutckpt.tiers import _saver

    write = _saver.write_piece

    def slow(*args, **kwargs):
        time.sleep(0.05)  # a slow disk, or a tier thread short of the GIL
        return write(*args, **kwargs)

    monkeypatch.setattr(_saver, "write_piece", slow)
    one_set = sum(a.nbytes for k, a in state(0).items() if k in ("w", "e", "n"))
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), local_keep_last=2, persist_every=100) as mgr:
        for step in range(1, 21):
            mgr.save(step, state(step), lc.Layout.replicated())  # not waited for
        # Two pieces kept, one being written and one being copied, however far the loop got.
        assert mgr._tiers._pool(False).held_bytes <= 4 * one_set
        mgr.wait()
        assert mgr.local_steps() == [19, 20]
        assert_state(mgr.load(lc.Layout.replicated()), 20)


def test_a_pool_views_a_buffer_alike_with_one_object_while_the_buffer_lives():
    from layoutckpt.torch._staging import HostBuffers

    pool = HostBuffers(None)
    buf = pool.acquire(96)
    a = pool.view(buf, torch.float32, (4, 6))
    assert pool.view(buf, torch.float32, torch.Size([4, 6])) is a
    assert pool.view(buf, torch.int32, (24,)) is not a
    assert a.data_ptr() == buf.data_ptr() and a.shape == (4, 6)
    del buf, a
    gc.collect()
    assert pool._views == {}  # gone with their buffer: its id may name another one now


def test_a_loan_gives_each_array_back_once_and_ends_once():
    from layoutckpt.tiers._local import _Loan

    done = []
    loan = _Loan(lambda: done.append(1))
    lent = [loan.lend(np.zeros(3)) for _ in range(3)]
    lent[0].release()
    lent[0].release()  # a second release of one array counts for nothing
    loan.seal()
    lent[1].release()
    assert done == []
    loan.recall()  # what is still out comes back: the last one ends the loan
    lent[2].release()
    assert done == [1]


def test_persists_and_held_pieces_share_the_host_copy_safely(tmp_path):
    with lc.CheckpointManager(
        tmp_path / "d", local=memory_url(), local_keep_last=2, persist_every=3, keep_last=2
    ) as mgr:
        for step in range(1, 16):
            mgr.save(step, state(step), lc.Layout.replicated())
        mgr.wait()
        assert mgr.steps() == [12, 15] or mgr.tier_metrics().persists_skipped > 0
        for step in mgr.steps():
            assert_state(lc.load(mgr.path(step)), step)
        for step in mgr.local_steps():
            assert_state(lc.load(mgr._tiers.tier.piece(step).url), step)


def test_a_persist_writes_straight_from_the_fast_tier_copy(tmp_path, monkeypatch):
    """The durable save of a step is written from the host copy the tier already holds: it
    stages nothing (no second copy of the state), and the durable checkpoint is bit-exact."""
    from layoutckpt import _save

    def refuse(*_a, **_k):
        raise AssertionError("a persist staged its state a second time")

    monkeypatch.setattr(_save, "stage_all", refuse)
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), persist_every=2) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step), lc.Layout.replicated())
        mgr.wait()
        assert mgr.tier_metrics().persists_failed == 0
        assert mgr.steps() == [2, 4]
        for step in mgr.steps():
            assert_state(lc.load(mgr.path(step)), step)


def test_retire_drops_the_piece_and_a_reader_of_it_fails_rather_than_read_reused_memory(tmp_path):
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), local_keep_last=2, persist_every=100) as mgr:
        mgr.save(1, state(1), lc.Layout.replicated()).result()
        url = mgr._tiers.tier.piece(1).url
        rd = lc.open(url)
        assert np.array_equal(rd.read("n"), state(1)["n"])
        free = mgr._tiers._pool(False)._free_bytes
        for step in (2, 3):
            mgr.save(step, state(step), lc.Layout.replicated()).result()
        piece = locate(url)
        assert not piece.committed() and not piece.exists() and piece.keys() == []
        assert mgr._tiers._pool(False)._free_bytes > free  # step 1's buffers are back in the pool
        with pytest.raises(lc.IntegrityError, match="not held"):
            rd.read("w")
        with pytest.raises(lc.CheckpointNotFoundError):
            lc.open(url)


def test_a_failed_write_keeps_the_earlier_pieces_and_gives_its_buffers_back(tmp_path):
    def fail(**_):
        raise OSError("out of memory for the tier")

    layout = lc.Layout.replicated()
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), persist_every=100) as mgr:
        for step in (1, 2):
            mgr.save(step, state(step), layout).result()
        pool = mgr._tiers._pool(False)
        held = pool._used_bytes  # the two pieces' buffers
        with _faults.hooks({"save.box_written": fail}):
            with pytest.raises(lc.SaveError, match="out of memory for the tier"):
                mgr.save(3, state(3), layout).result()
        assert pool._used_bytes == held  # step 3's buffers are back in the pool
        assert mgr.local_steps() == [1, 2] and not locate(mgr._tiers.tier.piece(3).url).exists()
        assert_state(mgr.load(layout), 2)
        mgr.save(3, state(3), layout).result()
        assert_state(mgr.load(layout), 3)


def test_a_gone_or_damaged_piece_falls_back_to_the_durable_tier(tmp_path):
    local = memory_url()
    layout = lc.Layout.replicated()
    with lc.CheckpointManager(tmp_path / "d", local=local, persist_every=2) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, state(step), layout)
            mgr.wait()
        assert mgr.local_steps() == [3, 4] and mgr.steps() == [2, 4]
    tier = locate(local.replace("{rank}", "0"))
    tier.write("step_00000004/zarr.json", b"{not json")  # a damaged marker: not a piece to restore
    with lc.CheckpointManager(tmp_path / "d", local=local, persist_every=2) as mgr:
        assert_state(mgr.load(layout), 4)
        assert mgr.tier_metrics().restored_from == "durable"
        assert_state(mgr.load(layout, step=3), 3)
        assert mgr.tier_metrics().restored_from == "local"
    tier.discard()  # the tier is lost (as when the process ends)
    with lc.CheckpointManager(tmp_path / "d", local=local, persist_every=2) as mgr:
        assert mgr.local_steps() == []
        assert_state(mgr.load(layout), 4)
        assert mgr.tier_metrics().restored_from == "durable"


def test_a_held_piece_opens_as_any_checkpoint(tmp_path, no_tensorstore_reads):
    with lc.CheckpointManager(tmp_path / "d", local=memory_url(), persist_every=100) as mgr:
        mgr.save(5, state(5), lc.Layout.replicated()).result()
        url = mgr._tiers.tier.piece(5).url
        with lc.open(url) as rd:
            assert rd.step == 5 and sorted(rd.keys()) == ["e", "empty", "n", "w"]
            assert torch.equal(rd.read_torch("w")[3:9, 7:11], state(5)["w"][3:9, 7:11])
            out = torch.empty(7, 5, dtype=torch.bfloat16)
            rd.read_torch("e", out=out)
            assert torch.equal(out.view(torch.int16), state(5)["e"].view(torch.int16))
            with pytest.raises(ValueError, match="held as host arrays"):
                rd.tensorstore("w")
        with mgr.reader() as rd:
            assert rd.step == 5 and np.array_equal(rd.read("n"), state(5)["n"])
        assert_state(lc.load(url), 5)


def test_other_memory_urls_stay_tensorstore_and_tiers_do_not_nest():
    name = f"held-{uuid.uuid4().hex[:8]}"
    _held.register(f"memory://{name}/0")
    assert isinstance(locate(f"memory://{name}/0/step_00000001"), _held.HeldPrefix)
    assert isinstance(locate(f"memory://{name}/1"), KvPrefix)
    assert isinstance(locate(f"memory://{name}/00"), KvPrefix)
    with pytest.raises(ValueError, match="give each tier a prefix of its own"):
        _held.register(f"memory://{name}")
    with pytest.raises(ValueError, match="give each tier a prefix of its own"):
        _held.register(f"memory://{name}/0/inner")


class TestHeldLocation(LocationTests):
    """The storage conformance suite on a held root (ordinary saves into it are copied once)."""

    def new_url(self) -> str:
        root = f"memory://held-conformance-{uuid.uuid4().hex[:8]}"
        _held.register(root)
        return f"{root}/ck"

    def test_the_box_reader_names_the_damaged_array(self):
        url = self.new_url()
        lc.save(url, {"w": np.arange(64, dtype=np.int64)})
        loc = locate(url)
        loc.root.delete(loc.prefix + "w")  # the array is gone, its documents remain
        with pytest.raises(lc.IntegrityError, match=r"array 'w' of checkpoint .* is damaged"):
            lc.open(url).read("w")

    def test_the_box_reader_lends_held_memory_and_its_lease_fails_once_the_array_is_dropped(self):
        url = self.new_url()
        w = np.arange(64, dtype=np.int64).reshape(8, 8)
        lc.save(url, {"w": w})
        loc = locate(url)
        meta = _store.read_meta(loc)
        reader = loc.box_reader(url, True, lc.IOConfig())
        lease = reader.lend("w", meta.arrays["w"], ((2, 5), (0, 8)))
        assert np.shares_memory(lease.data, loc.array(meta.arrays["w"]).data)  # no copy
        assert np.array_equal(lease.data, w[2:5])
        lease.check()
        loc.root.delete(loc.prefix + "w")  # retired while a device copy could still read it
        with pytest.raises(lc.IntegrityError, match=r"array 'w' .* retired while it was being read"):
            lease.check()
        assert reader.lend("w", meta.arrays["w"], ((0, 8), (0, 8))) is None  # gone: the read reports it

    def test_a_0d_array_is_saved_read_and_lent_as_an_array(self):
        """A 0-d box is ``()``: it indexes a held array as a 0-d view, not a NumPy scalar, on
        every path (the write's copy, the read's copy, and the lease a device restore takes)."""
        url = self.new_url()
        lc.save(url, {"step": np.array(7.0, np.float32), "n": torch.tensor(3)})
        assert lc.open(url).read("step") == 7.0 and lc.load(url)["n"].item() == 3
        meta = _store.read_meta(locate(url))
        lease = locate(url).box_reader(url, True, lc.IOConfig()).lend("step", meta.arrays["step"], ())
        assert isinstance(lease.data, np.ndarray) and lease.data.shape == () and lease.data == 7.0

    def test_the_box_writer_stores_whole_shards_and_parts_of_shards(self):
        """A whole array and the same array as two parts are held alike; a source that is not
        lent is copied and given back at once."""
        url = self.new_url()
        full = np.arange(40 * 24, dtype=np.float32).reshape(40, 24)
        lc.save(url, {"w": full})
        meta = lc.open(url).meta.arrays["w"]
        for n, boxes in enumerate(([((0, 40), (0, 24))], [((0, 13), (0, 24)), ((13, 40), (0, 24))])):
            staging = locate(f"{url}-{n}")
            sources = [_Given(full[tuple(slice(a, b) for a, b in box)].copy()) for box in boxes]
            with staging.box_writer(DEFAULT_IO) as writer:
                for box, source in zip(boxes, sources):
                    writer.write(meta, box, source)
                assert writer.join() == full.nbytes
            assert all(s.released for s in sources)
            reader = staging.box_reader(staging.url, True, DEFAULT_IO)
            assert np.array_equal(read_into(reader, [BoxRead("w", meta, ((3, 31), (2, 20)))])[0], full[3:31, 2:20])


def test_a_held_root_lists_and_deletes_by_prefix_across_its_folders():
    """Keys are kept by their first segment: prefixes within a folder, across folders
    (``step_1`` matches ``step_10``) and of a key that is itself a folder's name all answer as a
    flat store would."""
    root = _held.HeldRoot("keys")
    for key in ("step_1/zarr.json", "step_1/w/zarr.json", "step_10/zarr.json", "step_1", "replica_2/step_1/x"):
        root.write(key, b"d")
    root.put_array("step_1/w", _held.HeldArray(np.zeros(2)))
    root.put_array("step_10/w", _held.HeldArray(np.zeros(2)))
    assert root.keys("step_1/") == ["step_1/w", "step_1/w/zarr.json", "step_1/zarr.json"]
    assert root.keys("step_1") == [
        "step_1",
        "step_1/w",
        "step_1/w/zarr.json",
        "step_1/zarr.json",
        "step_10/w",
        "step_10/zarr.json",
    ]
    assert root.keys("step_1/w") == ["step_1/w", "step_1/w/zarr.json"]
    assert root.keys("replica_2/step_1/") == ["replica_2/step_1/x"]
    assert len(root.keys("")) == 7
    held = root.array("step_1/w")
    root.delete("step_1/", keep="step_1/zarr.json")
    assert root.keys("step_1") == ["step_1", "step_1/zarr.json", "step_10/w", "step_10/zarr.json"]
    assert held is not None and not held.alive and root.array("step_1/w") is None
    root.delete("step_1")
    assert root.keys("") == ["replica_2/step_1/x"]


class _Given:
    """A source that is not lent: the writer copies it and releases it at once."""

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.released = data, False

    def wait(self) -> np.ndarray:
        return self.data

    def release(self) -> None:
        self.released = True


# --- two ranks: the replica on a peer is held too ----------------------------------------------------


def _save_then_lose(rank, group, name, durable, lose):
    local = f"memory://{name}/{{rank}}"
    layout = lc.Layout(lc.Mesh({"tp": 2}), [(r"^w$", lc.P("tp", None)), (r".*", lc.P())])

    def mine(step):
        s = state(step)
        return {**s, "w": s["w"].chunk(2)[rank].clone()}

    with lc.CheckpointManager(durable, local=local, replicas=1, persist_every=100, group=group) as mgr:
        for step in range(1, 6):
            mgr.save(step, mine(step), layout).result()
        mgr.wait()
    replica = locate(f"memory://{name}/{rank}/replica_{1 - rank:05d}/step_00000005")
    assert isinstance(replica, _held.HeldPrefix) and replica.committed()
    if rank == lose:
        locate(local.format(rank=rank)).discard()
    with lc.CheckpointManager(durable, local=local, replicas=1, persist_every=100, group=group) as mgr:
        out = mgr.load(layout)
        want = mine(5)
        exact = all(torch.equal(out[k].view(torch.uint8), want[k].view(torch.uint8)) for k in ("w", "e"))
        return mgr.tier_metrics().restored_from, out["step"], exact, mgr.local_steps()


def test_a_rank_that_lost_its_memory_tier_restores_from_the_peer_replica(ranks, tmp_path):
    got = ranks.run(_save_then_lose, 2, uuid.uuid4().hex[:8], os.fspath(tmp_path / "d"), 1)
    assert got == [("local", 5, True, [4, 5]), ("peer", 5, True, [5])]
