"""Loading never materialises a whole global array: a rank's peak memory grows by about its shard.

Peak resident memory is read from ``VmHWM`` after resetting it through ``/proc/self/clear_refs``
(Linux), so each measurement covers exactly the load or read under test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import layoutckpt as lc

ROWS, COLS = 4096, 4096  # 64 MiB of float32
MIB = 1 << 20


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _peak()


def _peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _save(rank, group, path):
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    layout = lc.Layout(lc.Mesh({"tp": 2}), [(r".*", lc.P("tp", None))])
    lc.save(path, {"w": full.chunk(2)[rank].clone()}, layout, group=group)


def _load_columns(rank, group, path):
    layout = lc.Layout(lc.Mesh({"tp": 4}), [(r".*", lc.P(None, "tp"))])
    base = _reset_peak()
    out = lc.load(path, layout, group=group)
    grew = _peak() - base
    expected = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS).chunk(4, dim=1)[rank]
    assert torch.equal(out["w"], expected)
    return grew, out["w"].nbytes


def test_resharded_load_peak_is_near_the_local_shard(ranks, tmp_path):
    path = str(tmp_path / "ck")
    ranks.run(_save, 2, path)
    for grew, local in ranks.run(_load_columns, 4, path):
        assert local == ROWS * COLS * 4 // 4
        # The whole array is 64 MiB, this rank's shard 16 MiB. TensorStore's decode buffers may
        # briefly double the shard; the bound stays below one whole array. (The tighter target,
        # 1.3x plus a fixed overhead, is the benchmark's to report.)
        assert grew <= 2 * local + 16 * MIB < ROWS * COLS * 4, (
            f"peak grew {grew / MIB:.1f} MiB for a {local / MIB:.0f} MiB shard"
        )


def test_partial_read_peak_is_near_the_slice(ranks, tmp_path):
    path = str(tmp_path / "ck")
    ranks.run(_save, 2, path)
    rd = lc.open(path)
    base = _reset_peak()
    part = rd.read("w", np.s_[:, 0:512])
    grew = _peak() - base
    assert part.shape == (ROWS, 512)
    assert part[5, 7] == 5 * COLS + 7
    assert grew <= 2 * part.nbytes + 16 * MIB < ROWS * COLS * 4, (
        f"peak grew {grew / MIB:.1f} MiB for an {part.nbytes / MIB:.0f} MiB slice"
    )
