from __future__ import annotations

import torch

import layoutckpt as lc


def _save_tp(rank, group, path):
    mesh = lc.Mesh({"dp": 2, "tp": 2})
    layout = lc.Layout(mesh, [(r"\.w$", lc.P("tp", None)), (r"\.e$", lc.P(("dp", "tp"))), (r".*", lc.P())])
    full_w = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    full_e = torch.arange(7, dtype=torch.int64)
    c = mesh.coords(rank)
    state = {
        "m": {
            "w": full_w.chunk(2)[c["tp"]],
            "e": list(full_e.chunk(4))[rank] if rank < len(full_e.chunk(4)) else full_e[:0],
            "b": torch.ones(3),
        }
    }
    return lc.save(path, state, layout, group=group).bytes_written


def _load_tp3(rank, group, path):
    mesh = lc.Mesh({"tp": 3})
    layout = lc.Layout(mesh, [(r"\.w$", lc.P(None, "tp")), (r".*", lc.P("tp"))])
    out = lc.load(path, layout, group=group)
    full_w = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)
    assert torch.equal(out["m"]["w"], full_w.chunk(3, dim=1)[rank])
    e = torch.arange(7, dtype=torch.int64).chunk(3)
    assert torch.equal(out["m"]["e"], e[rank])
    return True


def test_save_4_load_3(ranks, tmp_path):
    path = str(tmp_path / "ck")
    written = ranks.run(_save_tp, 4, path)
    assert sum(written) == 10 * 6 * 4 + 7 * 8 + 3 * 4
    assert ranks.run(_load_tp3, 3, path) == [True] * 3


def _save_again(rank, group, root):
    """Save one state four times: the second reuses the first's plan; the third changes a
    shape on every rank, the fourth on rank 1 alone."""
    from layoutckpt import _save

    _save._PLANS.clear()  # the pool's processes outlive tests that may save equal states
    planned = []
    real = _save._plan_globally

    def counting(*args, **kwargs):
        planned.append(rank)
        return real(*args, **kwargs)

    _save._plan_globally = counting
    try:
        mesh = lc.Mesh({"tp": 2})
        layout = lc.Layout(mesh, [(r"\.w$", lc.P("tp", None)), (r".*", lc.P())])
        counts = []
        for step, norm in enumerate([3, 3, 5]):
            w = (torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + 100 * step).chunk(2)[rank]
            lc.save(f"{root}/s{step}", {"m": {"w": w, "b": torch.full((norm,), float(step))}}, layout, group=group)
            counts.append(len(planned))
        try:  # rank 1's shard has a row too many: the cached plan on rank 0 must not hide it
            w = torch.zeros(4 + rank, 4)
            lc.save(f"{root}/s3", {"m": {"w": w, "b": torch.ones(5)}}, layout, group=group)
            refused = ""
        except lc.InconsistentShardsError as err:
            refused = str(err)
        return counts, refused
    finally:
        _save._plan_globally = real


def test_a_repeated_save_reuses_its_plan_and_replans_when_a_shape_changes(ranks, tmp_path):
    results = ranks.run(_save_again, 2, str(tmp_path))
    assert [counts for counts, _ in results] == [[1, 1, 2], [1, 1, 2]]
    assert "rank 1 holds a shard of shape (5, 4)" in results[1][1]
    assert results[0][1] and results[1][1]
    full = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    for step, norm in enumerate([3, 3, 5]):
        r = lc.open(tmp_path / f"s{step}")
        assert torch.equal(torch.from_numpy(r.read("m.w")), full + 100 * step)
        assert torch.equal(torch.from_numpy(r.read("m.b")), torch.full((norm,), float(step)))
    assert not (tmp_path / "s3").exists()
