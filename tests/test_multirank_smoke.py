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
