"""A load whose plan or reads fail on some ranks only fails on every rank, on real gloo ranks.

A model whose global shape changed since the save can still fit some ranks' shards: 3 rows
split over 2 ranks are 2 and 1, and a template of 4 rows (2 and 2) fits rank 0 alone. Rank 1
raises, and rank 0 must too: a rank that loads while its peer raises goes on alone into the
next collective of the training loop, and waits there for ever. The same holds for a chunk
that is damaged where one rank alone reads it."""

from __future__ import annotations

from pathlib import Path

import torch

import layoutckpt as lc
from tests.support.multirank import RankPool

LAYOUT = lc.Layout(lc.Mesh({"tp": 2}), [(r".*", lc.P("tp"))])


def _grown(rank: int, group, path: str) -> str | None:
    lc.save(path, {"w": torch.arange(3.0)[[0, 1] if rank == 0 else [2]]}, LAYOUT, group=group)
    try:
        lc.load(path, LAYOUT, like={"w": torch.zeros(2)}, group=group)  # 4 rows now: 2 on each rank
    except lc.TemplateMismatchError as err:
        return str(err)
    return None


def test_a_template_that_fits_only_some_ranks_fails_the_load_on_every_rank(ranks: RankPool, tmp_path: Path) -> None:
    mine, theirs = ranks.run(_grown, 2, str(tmp_path / "ck"))
    assert theirs is not None and "'w'" in theirs and "other ranks" not in theirs, theirs
    assert mine is not None and "rank 1: TemplateMismatchError" in mine and "'w'" in mine, mine


def _missing_on_rank_1(rank: int, group, path: str) -> str:
    lc.save(path, {"w": torch.arange(4.0)}, LAYOUT, group=group)
    try:
        lc.load(path if rank == 0 else path + "-elsewhere", LAYOUT, group=group)
    except (lc.CheckpointNotFoundError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_a_checkpoint_one_rank_cannot_find_fails_the_load_on_every_rank(ranks: RankPool, tmp_path: Path) -> None:
    mine, theirs = ranks.run(_missing_on_rank_1, 2, str(tmp_path / "ck"), timeout=60)
    assert theirs.startswith("CheckpointNotFoundError"), theirs
    assert mine.startswith("RuntimeError") and "rank 1: CheckpointNotFoundError" in mine, mine


def _rank_0_alone(rank: int, group, path: str) -> bool | None:
    import torch.distributed as dist

    torch.manual_seed(0)  # the same weights on every rank
    model = torch.nn.Linear(2, 2)
    lc.save(path, lc.get_state(model), group=group)
    got = None
    if rank == 0:  # an evaluation on rank 0
        got = lc.load(path, group=group)["model"]["bias"].tolist()
        lc.load_state(path, torch.nn.Linear(2, 2), group=group)
    dist.barrier(group)
    return got == model.bias.tolist() if rank == 0 else None


def test_a_load_of_whole_arrays_is_no_collective(ranks: RankPool, tmp_path: Path) -> None:
    """Whole arrays into plain tensors: every rank loads the same, so rank 0 may load alone
    (lc.load, lc.load_state of a plain model)."""
    assert ranks.run(_rank_0_alone, 2, str(tmp_path / "ck"), timeout=60) == [True, None]


def _damaged_on_rank_1(rank: int, group, path: str) -> str:
    import torch.distributed as dist

    lc.save(path, {"w": torch.arange(4.0)[:2] + 2 * rank}, LAYOUT, group=group)
    if rank == 0:
        shard = Path(path, "w", "c.1")  # rows 2-3: only rank 1 reads them
        raw = bytearray(shard.read_bytes())
        raw[0] ^= 0xFF  # the first chunk's first byte: its crc32c fails
        shard.write_bytes(bytes(raw))
    dist.barrier(group)
    try:
        lc.load(path, LAYOUT, group=group)
    except (lc.IntegrityError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_damage_that_one_rank_reads_fails_the_load_on_every_rank(ranks: RankPool, tmp_path: Path) -> None:
    """The reads fail on rank 1 only, after the plan's agreement: rank 0, whose part is intact,
    raises too, naming rank 1, rather than resume alone."""
    mine, theirs = ranks.run(_damaged_on_rank_1, 2, str(tmp_path / "ck"), timeout=60)
    assert theirs.startswith("IntegrityError") and "'w'" in theirs, theirs
    assert mine.startswith("IntegrityError") and "rank 1: IntegrityError" in mine, mine


def _result_at_different_points(rank: int, group, path: str) -> list[float]:
    import torch.distributed as dist

    lc.save(path, {"w": torch.arange(4.0)[:2] + 2 * rank}, LAYOUT, group=group)
    fut = lc.load_async(path, LAYOUT, group=group)  # prefetched during the step
    grad = torch.full((2,), float(rank + 1))
    if rank == 0:
        state = fut.result()
        dist.all_reduce(grad, group=group)
    else:
        dist.all_reduce(grad, group=group)
        state = fut.result()
    return [*state["w"].tolist(), *grad.tolist()]


def test_load_async_result_is_no_collective(ranks: RankPool, tmp_path: Path) -> None:
    """Rank 0 takes its prefetched state before the step's all-reduce, rank 1 after: result()
    must not meet the all-reduce in a collective of its own."""
    got = ranks.run(_result_at_different_points, 2, str(tmp_path / "ck"), timeout=60)
    assert got == [[0.0, 1.0, 3.0, 3.0], [2.0, 3.0, 3.0, 3.0]]
