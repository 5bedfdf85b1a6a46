"""Per-phase metrics of saves and loads: the result objects and the ``layoutckpt`` log records."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt.base._options import DEFAULT_IO
from layoutckpt.storage._readers import ShardFileReader

MB = 1 << 20


def _state():
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(5 * MB // 4, generator=g).reshape(-1, 256), "small": torch.ones(7), "n": 3}


def test_save_metrics_phases_bytes_and_log(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="layoutckpt")
    state = _state()
    res = lc.save(tmp_path / "ck", state)
    m = res.metrics
    assert isinstance(m, lc.Metrics)
    assert (m.operation, m.rank, m.world, m.path) == ("save", 0, 1, str(tmp_path / "ck"))
    assert [n for n, _ in m.phases] == ["plan", "stage", "write", "commit"]
    assert m.phase("stage") == 0.0  # a synchronous save writes from the live tensors
    assert all(s >= 0 for _, s in m.phases) and sum(s for _, s in m.phases) <= m.seconds + 1e-3
    assert m.bytes == res.bytes_written == state["big"].nbytes + state["small"].nbytes
    assert m.arrays == 2 and m.requests == res.arrays_written == 2
    assert 1 <= m.max_in_flight <= 2 and m.max_in_flight_bytes <= m.bytes
    assert m.gb_per_s == pytest.approx(m.bytes / m.seconds / 1e9)
    with pytest.raises(KeyError, match="no phase 'read'"):
        m.phase("read")

    (record,) = [r for r in caplog.records if r.name == "layoutckpt"]
    assert record.levelno == logging.INFO
    assert record.layoutckpt == m.to_dict()
    assert record.layoutckpt["phases"]["write"] == m.phase("write")
    assert "save " in record.getMessage() and "GB/s" in record.getMessage()


def test_async_save_metrics_count_the_copy(tmp_path):
    res = lc.save_async(tmp_path / "ck", _state()).result()
    m = res.metrics
    assert m.operation == "save_async"
    assert m.phase("stage") > 0 and res.staged_bytes == m.bytes


def test_load_metrics_count_what_was_read(tmp_path, caplog):
    state = _state()
    # An object store (memory:// stands for one): reads go through TensorStore, in pieces.
    path = "memory://test-metrics/ck"
    lc.save(path, state)
    # Small pieces: the 5 MiB array becomes several reads, at most 2 MiB in flight.
    io = lc.IOConfig(piece_bytes=MB, budget_bytes=2 * MB)
    caplog.set_level(logging.INFO, logger="layoutckpt")
    caplog.clear()  # the save's record, where the logger already was at INFO
    fut = lc.load_async(path, io=io)
    assert fut.metrics is None  # known once the load is done
    out = fut.result()
    assert torch.equal(out["big"], state["big"])
    m = fut.metrics
    assert m.operation == "load" and [n for n, _ in m.phases] == ["plan", "read", "place"]
    assert m.bytes == state["big"].nbytes + state["small"].nbytes
    assert m.arrays == 2
    assert m.requests >= 5 + 1  # pieces of at most 1 MiB, and the small array
    assert m.max_in_flight >= 2 and m.max_in_flight_bytes <= 2 * MB  # the budget held
    assert [r.layoutckpt for r in caplog.records if r.name == "layoutckpt"] == [m.to_dict()]

    # A partial load reads only what it selects.
    fut = lc.load_async(path, select=["small"])
    fut.result()
    assert fut.metrics.bytes == state["small"].nbytes and fut.metrics.requests == 1

    # A local directory: shard files are read in place, one request per box, a few at a time.
    lc.save(tmp_path / "ck", state)
    fut = lc.load_async(tmp_path / "ck")
    assert torch.equal(fut.result()["big"], state["big"])
    m = fut.metrics
    assert m.bytes == state["big"].nbytes + state["small"].nbytes and m.requests == 2
    assert 1 <= m.max_in_flight <= DEFAULT_IO.threads


def _save_and_report(rank, group, path):
    mesh = lc.Mesh({"tp": 2})
    layout = lc.Layout(mesh, [(r"^w$", lc.P("tp")), (r".*", lc.P())])
    w = torch.arange(64, dtype=torch.float32).chunk(2)[rank]
    res = lc.save(path, {"w": w, "b": np.ones(4)}, layout, group=group)
    m = res.metrics
    f = lc.load_async(path, layout, group=group)
    f.result()
    return m.rank, m.world, m.bytes, f.metrics.bytes


def test_metrics_per_rank(ranks, tmp_path):
    got = ranks.run(_save_and_report, 2, str(tmp_path / "ck"))
    assert [(r, w) for r, w, _, _ in got] == [(0, 2), (1, 2)]
    assert sum(b for _, _, b, _ in got) == 64 * 4 + 4 * 8  # the replicated array is written once
    assert [lb for *_, lb in got] == [32 * 4 + 32, 32 * 4 + 32]  # each rank reads its half and the replica


def test_load_future_result_honours_timeout(tmp_path, monkeypatch):
    lc.save(tmp_path / "ck", _state())
    gate = __import__("threading").Event()
    read = ShardFileReader.read  # a local checkpoint's boxes are read here

    def slow_read(self, *args, **kwargs):
        gate.wait()  # the reads cannot finish until the test lets them
        return read(self, *args, **kwargs)

    monkeypatch.setattr(ShardFileReader, "read", slow_read)
    fut = lc.load_async(tmp_path / "ck")
    with pytest.raises(TimeoutError, match=r"not done within 0\.2 s"):
        fut.result(timeout=0.2)
    assert not fut.done()
    gate.set()
    out = fut.result(timeout=30)
    assert torch.equal(out["small"], torch.ones(7)) and fut.done()
