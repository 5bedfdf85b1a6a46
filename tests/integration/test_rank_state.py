"""Per-rank state (``rank_state=``): each rank stores one JSON document of its own.

What this file proves:

- four ranks each save a different document (data loader position, ``torch.get_rng_state()``,
  NumPy and bf16 arrays, bytes, tuples, nan/inf/-0.0, nested dicts with int keys); loading on four
  ranks gives each rank exactly its own, bit-exact and with its types (a tuple stays a tuple, an
  int key stays an int), and the RNG state restored continues the same random stream;
- on another world size ``load_rank_state`` refuses with a ``WorldSizeError`` that points to
  ``redistribute=``, and with ``redistribute`` each rank gets what the function chose;
- ``lc.open(path).rank_states()`` reads all documents in a plain process; user metadata is
  readable without touching an array; plain ``zarr`` walks the checkpoint without a warning;
- a checkpoint without per-rank state raises ``KeyError``; a value that cannot be stored raises
  ``TypeError`` on every rank before anything is written; ranks that disagree about passing
  ``rank_state`` all raise ``InconsistentShardsError``.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import zarr

import layoutckpt as lc
from tests.support.oracle import local_shard

AXES = {"dp": 2, "tp": 2}
LAYOUT = lc.Layout(lc.Mesh(AXES), [(r"\.w$", lc.P("tp", None)), (r".*", lc.P())])
METADATA = {"run": "rs-1", "lr": 0.25, "tags": ["a", "b"], "nested": {"k": None}}


def full_arrays() -> dict:
    return {
        "model": {
            "w": torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) / 3,
            "b": torch.linspace(-1, 1, 5).to(torch.bfloat16),
        }
    }


def local_arrays(rank: int) -> dict:
    full = full_arrays()["model"]
    return {"model": {"w": local_shard(full["w"], lc.P("tp", None), AXES, rank).clone(), "b": full["b"].clone()}}


def rng_state_of(rank: int) -> torch.Tensor:
    """The CPU generator's state after some draws, as a training loop would save it."""
    with torch.random.fork_rng():
        torch.manual_seed(100 + rank)
        torch.rand(rank + 3)
        return torch.get_rng_state()


def rank_state_of(rank: int) -> dict:
    """A different document on every rank, with every kind of value ``rank_state=`` accepts."""
    return {
        "loader": {"epoch": 2, "batches_seen": 1000 + rank, "seed": 2**40 + rank, "done": False},
        "rng": rng_state_of(rank),
        "noise": np.linspace(0, 1, 5, dtype=np.float32) * (rank + 1),
        "ids": np.array([[rank, -rank], [2**60, 7]], dtype=np.int64),
        "scale": torch.tensor([1.5, -2.0, float("nan")], dtype=torch.bfloat16) * (rank + 1),
        "blob": bytes([rank, 0, 255, 10, 13]),
        "pair": (rank, "r", None, (1.5, True)),
        "floats": [float("nan"), float("-inf"), -0.0, 1e-300],
        "by_int": {0: "zero", 10 + rank: {"deep": [rank, None, False]}, "name": f"rank{rank}"},
        "empty": {"d": {}, "l": [], "t": ()},
    }


def assert_same(got, want, where: str = "rank_state") -> None:
    """Equal values of exactly the same types; tensors and arrays bit for bit."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} instead of {type(want).__name__}"
    if isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], f"{where}: keys differ"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), f"{where}: length"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes()), where
    elif isinstance(want, float):
        assert (math.isnan(got) and math.isnan(want)) or (
            got == want and math.copysign(1, got) == math.copysign(1, want)
        )
    else:
        assert got == want, where


# --- rank functions -----------------------------------------------------------------------------


def _save(rank, group, path):
    fut = lc.save_async(
        path, local_arrays(rank), LAYOUT, group=group, rank_state=rank_state_of(rank), metadata=METADATA
    )
    return fut.result().bytes_written


def _load_own(rank, group, path):
    mine = lc.load_rank_state(path, group=group)
    # The restored generator continues exactly where the saved one was.
    with torch.random.fork_rng():
        torch.set_rng_state(mine["rng"])
        restored = torch.rand(4)
        torch.set_rng_state(rng_state_of(rank))
        original = torch.rand(4)
    return mine, torch.equal(restored, original)


def _load_without_redistribute(rank, group, path):
    lc.load_rank_state(path, group=group)


def _load_redistributed(rank, group, path):
    calls = []

    def redistribute(states, rank, world):
        calls.append((len(states), rank, world))
        return states[rank::world]

    return lc.load_rank_state(path, group=group, redistribute=redistribute), calls


def _save_unstorable(rank, group, path, bad_ranks):
    state = rank_state_of(rank)
    if rank in bad_ranks:
        state["loader"]["sampler"] = object()
    lc.save_async(path, local_arrays(rank), LAYOUT, group=group, rank_state=state)


def _save_only_some(rank, group, path):
    lc.save_async(path, local_arrays(rank), LAYOUT, group=group, rank_state=rank_state_of(rank) if rank % 2 else None)


# --- tests --------------------------------------------------------------------------------------


@pytest.fixture
def saved(ranks, tmp_path):
    """A checkpoint saved by four ranks, each with its own ``rank_state_of(rank)``."""
    path = tmp_path / "ck"
    ranks.run(_save, 4, str(path))
    return path


def test_each_rank_gets_its_own_state_back(ranks, saved):
    for rank, (mine, rng_continues) in enumerate(ranks.run(_load_own, 4, str(saved))):
        assert_same(mine, rank_state_of(rank), f"rank {rank}")
        assert rng_continues


def test_plain_process_reads_all_states_and_metadata(saved):
    reader = lc.open(saved)
    states = reader.rank_states()
    assert len(states) == 4
    for rank, state in enumerate(states):
        assert_same(state, rank_state_of(rank), f"rank {rank}")
    assert reader.metadata == METADATA
    # The arrays are unaffected by the documents next to them.
    out = lc.load(saved)
    assert torch.equal(out["model"]["w"], full_arrays()["model"]["w"])
    assert torch.equal(out["model"]["b"].view(torch.int16), full_arrays()["model"]["b"].view(torch.int16))


def test_other_world_size_needs_redistribute(ranks, saved):
    for tb in ranks.run_expecting_errors(_load_without_redistribute, 2, str(saved)):
        assert "WorldSizeError" in tb
        assert "4 ranks" in tb and "has 2" in tb and "redistribute=" in tb and "rank_states()" in tb
    for rank, (mine, calls) in enumerate(ranks.run(_load_redistributed, 2, str(saved))):
        assert calls == [(4, rank, 2)]
        assert isinstance(mine, list) and len(mine) == 2
        for got, saved_rank in zip(mine, (rank, rank + 2)):
            assert_same(got, rank_state_of(saved_rank), f"rank {rank} <- saved rank {saved_rank}")


def test_plain_zarr_walks_the_checkpoint(saved):
    # pytest turns warnings into errors here, so any warning from zarr fails this test.
    group = zarr.open_group(saved, mode="r")
    members = dict(group.members(max_depth=None))
    assert {".rank_state", *(f".rank_state/{r:05d}" for r in range(4)), "model/w", "model/b"} <= set(members)
    doc = dict(group[".rank_state/00002"].attrs)["layoutckpt_rank_state"]
    assert (doc["rank"], doc["world"]) == (2, 4)
    assert group["model/w"][...].tobytes() == full_arrays()["model"]["w"].numpy().tobytes()
    b = full_arrays()["model"]["b"]
    assert group["model/b"][...].tobytes() == b.view(torch.int16).numpy().tobytes()


def test_checkpoint_without_rank_state(tmp_path):
    path = tmp_path / "ck"
    lc.save(path, full_arrays(), lc.Layout.replicated())
    with pytest.raises(KeyError, match="holds no per-rank state"):
        lc.load_rank_state(path)
    assert lc.open(path).rank_states() == []
    assert not (path / ".rank_state").exists()


@pytest.mark.parametrize("bad_ranks", [(0, 1, 2, 3), (2,)], ids=["every-rank", "rank-2"])
def test_unstorable_value_is_refused_before_writing(ranks, tmp_path, bad_ranks):
    path = tmp_path / "ck"
    errors = ranks.run_expecting_errors(_save_unstorable, 4, str(path), bad_ranks)
    for rank, tb in enumerate(errors):
        if rank in bad_ranks:
            assert "TypeError" in tb and "object" in tb and "rank_state" in tb and "sampler" in tb
        else:
            # A rank whose own value was fine learns which rank refused, and why.
            assert "InconsistentShardsError" in tb and "rank 2: TypeError" in tb
    assert os.listdir(tmp_path) == []


def test_ranks_disagreeing_about_rank_state_all_raise(ranks, tmp_path):
    for tb in ranks.run_expecting_errors(_save_only_some, 4, str(tmp_path / "ck")):
        assert "InconsistentShardsError" in tb and "rank_state" in tb
    assert os.listdir(tmp_path) == []


def test_numpy_scalars_come_back_as_scalars(tmp_path):
    state = {"i": np.int64(5), "f": np.float32(0.5), "b": np.bool_(True), "a": np.arange(3)}
    lc.save(tmp_path / "ck", {"w": np.ones(2)}, rank_state=state)
    got = lc.load_rank_state(tmp_path / "ck")
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in state.items()}
    assert got["i"] == 5 and hash(got["i"]) == hash(5) and np.array_equal(got["a"], np.arange(3))


def _edit_document(path, old: str, new: str) -> None:
    doc = os.path.join(path, ".rank_state", "00000", "zarr.json")
    with open(doc) as f:
        text = f.read()
    assert old in text
    with open(doc, "w") as f:
        f.write(text.replace(old, new, 1))


def test_an_edited_per_rank_document_fails_its_checksum(tmp_path):
    """A data position changed from 4096 to 4098 would resume the loader elsewhere, silently."""
    path = str(tmp_path / "ck")
    lc.save(path, {"w": np.ones(2)}, rank_state={"pos": 4096})
    _edit_document(path, "4096", "4098")
    with pytest.raises(lc.IntegrityError, match="per-rank state fails its sha256"):
        lc.load_rank_state(path)
    from layoutckpt._verify import verify

    with lc.open(path) as rd:
        assert not verify(rd).ok


def test_an_array_whose_shape_disagrees_with_its_bytes_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    lc.save(path, {"w": np.ones(2)}, rank_state={"rng": np.arange(4, dtype=np.uint8)})
    _edit_document(path, '"sha256"', '"unchecked"')  # as a document written before the checksum
    _edit_document(path, '"shape": [4]', '"shape": [2, -1]')
    with pytest.raises(lc.FormatError, match="not a list of sizes"):
        lc.load_rank_state(path)
