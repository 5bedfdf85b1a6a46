"""``benchmarks/bench.py --quick`` runs end to end and reports every operation of every system.

The benchmark's numbers are not checked (they are the lead's to read); its shape is: one row per
operation, system and cache state, for each world size, with positive times, and the targets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.paths import BENCHMARKS, REPO

BENCH = BENCHMARKS / "bench.py"

WRITE_ROWS = {
    "save": [
        "raw write+fsync",
        "raw write+fsync, 8 streams",
        "layoutckpt save",
        "torch.save+fsync",
        "DCP save",
        "safetensors save_file+fsync (rank 0)",
    ],
    "save_async blocked": ["memcpy (staging bound)", "layoutckpt save_async", "DCP async_save"],
    "save_async commit": ["raw write+fsync", "layoutckpt save_async", "DCP async_save"],
}
PARTIAL = ["raw read", "layoutckpt open().read", "torch.load whole ckpt", "torch.load(mmap=True)"]
IN_PLACE = [
    "memcpy",
    "raw read into a buffer",
    "checked read into the tensors",
    "layoutckpt load(inplace=True)",
    "DCP load",
]
READ_ROWS = {
    "load": ["raw read", "layoutckpt load", "torch.load", "DCP load", "safetensors load_file (rank 0)"],
    "load resharded": ["raw read", "layoutckpt load", "DCP load"],
    "load in place": IN_PLACE,
    "load resharded in place": IN_PLACE,
    "read 1 tensor (rank 0)": PARTIAL,
    "read 8 rows (rank 0)": PARTIAL,
}


def run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` of ``benchmarks/`` run as its README shows; its output where it fails."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=REPO,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _dcp_available() -> bool:
    try:
        import torch.distributed.checkpoint  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        return False
    return True


def _expected() -> set[tuple[str, str, str | None]]:
    rows = {(op, s, None) for op, systems in WRITE_ROWS.items() for s in systems}
    rows |= {(op, s, c) for op, systems in READ_ROWS.items() for s in systems for c in ("cold", "warm")}
    if not _dcp_available():
        rows = {r for r in rows if not r[1].startswith("DCP")}
    return rows


def test_quick_run_reports_every_row(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_benchmark(
        "bench.py", "--quick", "--ranks", "1,2", "--repeats", "1", "--json", str(out), "--dir", str(tmp_path)
    )
    assert "targets for 2 rank(s)" in proc.stdout
    results = json.loads(out.read_text())
    assert sorted(results["worlds"]) == ["1", "2"]
    assert results["eviction_check"]["works"] in (True, False)
    for world, res in results["worlds"].items():
        got = {(r["op"], r["system"], r["cache"]) for r in res["rows"]}
        missing = _expected() - got
        assert not missing, f"{world} rank(s): no rows for {sorted(missing)}"
        for r in res["rows"]:
            assert r["median"] > 0 and r["min"] > 0, (world, r["op"], r["system"], r["cache"])
            assert r["gbps"] > 0 and r["peak_rss"] > 0
            if r["cache"]:
                assert r["bytes_needed"] > 0
        # every same-layout load gave the state back, both reshards agree, and the partial reads
        # gave rank 0's first rows (and one tensor in every system)
        assert res["digest_checks"] and all(res["digest_checks"].values()), res["digest_checks"]
        assert {"lc_read_tensor rows", "lc_read_rows rows", "torch_load_whole == lc_read_tensor"} <= set(
            res["digest_checks"]
        )
        # one timed repeat per write; the default warm-up round before it is not kept
        assert results["options"]["warmup"] == 1
        assert all(len(rank["results"]["lc_save"]) == 1 for rank in res["per_rank"])
        names = [t["name"] for t in res["targets"]]
        # 9 of the first issues, then issue 26's warm loads (in place against DCP, ByteCheckpoint where
        # it imports, memcpy; into fresh tensors against DCP) and the replicated tensor's write balance
        bcp = results["bytecheckpoint"] == "installed"
        assert len(names) == 9 + 2 * (3 if bcp else 2) + 2 + 1, names
        # with one rank a resharded load moves nothing: its speed targets are not applicable
        verdicts = {t["name"]: t["verdict"] for t in res["targets"]}
        resharded = [
            n for n in verdicts if n.startswith(("resharding load GB/s", "warm in-place resharded", "warm resharded"))
        ]
        assert len(resharded) == (5 if bcp else 4), resharded
        for name, verdict in verdicts.items():
            one_rank = world == "1" and name in resharded
            assert verdict == "n/a (one rank: no reshard)" if one_rank else verdict in ("PASS", "MISS"), (name, verdict)
        balance = res["write_balance"]
        assert balance["replicated"]["lc"]["files"] >= 1 and balance["lc"]["max_over_mean"] >= 1
        # the parallel raw write keeps 8 files in flight over all ranks; the save targets' context
        assert res["files_written"]["raw_streams"] == 8
        context = res["save_context"]
        dcp = {"DCP save", "1.5x DCP save"} if _dcp_available() else set()
        assert set(context) == {"parallel raw write", "layoutckpt save"} | dcp
        if dcp:
            assert context["1.5x DCP save"] == pytest.approx(1.5 * context["DCP save"])
        # warm in-place loads over the checked read of the same bytes, the floor of a checked load
        for op in ("load in place", "load resharded in place"):
            ratios = res["load_context"][op]
            assert ratios["layoutckpt"] > 0
            if dcp:
                assert ratios["2x DCP"] == pytest.approx(2 * ratios["DCP"])
        # the library's default packing: the quick state is small, so plain files
        assert results["options"]["packing"] == "auto" and res["lc_packing"] == "files"


@pytest.mark.parametrize("only", ["partial,lc", "reshard,lc", "nosuch"])
def test_only_selects_or_refuses(only, tmp_path):
    sys.path.insert(0, str(BENCH.parent))
    try:
        import bench
    finally:
        sys.path.remove(str(BENCH.parent))
    if only == "nosuch":
        with pytest.raises(SystemExit):
            bench.select(only)
        return
    chosen = bench.select(only)
    if only == "reshard,lc":
        # the resharded loads with the load limits that bound them, and the writes they read
        limits = {"raw_read", "memcpy_load", "raw_read_into", "checked_read_into"}
        assert set(chosen) == {"lc_reshard", "lc_reshard_inplace", "lc_save", "raw_write"} | limits
        return
    # lc's partial reads, the raw limits beside them, and the writes they read
    assert set(chosen) == {"lc_read_tensor", "lc_read_rows", "raw_read_tensor", "raw_read_rows", "lc_save", "raw_write"}


def test_the_tiers_benchmark_runs_every_mode_and_restore(tmp_path):
    """``tiers.py`` on a tiny model: 12 steps, so that step 10 is persisted and then retired
    from the fast tier (which keeps 2), and the durable restore reads the durable tier."""
    out = tmp_path / "tiers.json"
    small = ["--dim", "32", "--layers", "1", "--vocab", "64", "--batch", "2", "--seq", "8", "--steps", "12"]
    run_benchmark("tiers.py", "--repeats", "1", *small, "--json", str(out), "--dir", str(tmp_path))
    summary = json.loads(out.read_text())
    assert list(summary["rows"]) == ["none", "tiers", "lazy", "dcp"]
    assert all(row["step_s"] > 0 and row["mean_s"] > 0 for row in summary["rows"].values())
    assert summary["rows"]["tiers"]["copy_s"] > 0 and summary["rows"]["lazy"]["copy_s"] > 0
    for kind in ("fresh", "inplace"):
        r = summary["restore"][kind]
        assert r["fast_s"] > 0 and r["durable_s"] > 0 and r["cold_s"] > 0


@pytest.mark.parametrize(("layout", "writers_nodes"), [("fsdp", 1), ("hsdp", 4)])
def test_the_pack_index_benchmark_finds_every_shard_in_its_writers_databases(tmp_path, layout, writers_nodes):
    """``pack_index.py`` on 32 ranks: every shard found both ways; through the writers'
    databases, one node of the writer's (FSDP) or of each of the piece's 4 holders (HSDP)."""
    small = ["--ranks", "32", "--arrays", "12", "--repeats", "2", "--layout", layout, "--dir", str(tmp_path)]
    proc = run_benchmark("pack_index.py", *small)
    nodes = dict(re.findall(r"^(merged root|writers' databases) .* B\+tree nodes read (\d+)$", proc.stdout, re.M))
    assert nodes == {"merged root": "1", "writers' databases": str(writers_nodes)}, proc.stdout


def test_the_shared_reads_benchmark_fetches_the_state_once_when_shared():
    """``shared_reads.py`` on 2 ranks: alone, the ranks fetch the state from S3 twice over;
    sharing, once (each array's parts, and their indexes)."""
    proc = run_benchmark("shared_reads.py", "--gb", "0.005", "--ranks", "2", "--repeats", "1")
    fetched = {way: float(x) for way, x in re.findall(r"^(alone|shared) .* ([\d.]+)$", proc.stdout, re.M)}
    assert set(fetched) == {"alone", "shared"}, proc.stdout
    assert fetched["alone"] >= 2.0 and fetched["shared"] < 1.2, proc.stdout


def test_the_per_array_benchmark_reports_every_operation(tmp_path):
    """``per_array.py`` on 40 arrays: a row per operation, each with layoutckpt's figure."""
    proc = run_benchmark("per_array.py", "--arrays", "40", "--repeats", "1", "--dir", str(tmp_path))
    for op in ("save", "save_async blocked", "tier save blocked", "load in place"):
        assert re.search(rf"^{op} +\d+ \(", proc.stdout, re.M), proc.stdout


def test_the_byte_passes_benchmark_times_every_pass_and_leaves_no_file(tmp_path):
    """``byte_passes.py`` on a few MiB: a row per pass with its time and its ratio to memcpy
    (1.00 for memcpy itself), and its scratch file removed."""
    proc = run_benchmark("byte_passes.py", "--gib", "0.01", "--repeats", "1", "--dir", str(tmp_path))
    passes = ("memcpy", "kernel copy", "crc32c", "tiles", "checked read", "checked read, tiles")
    found = dict(re.findall(r"^(\S.*?) +\d+ \(\d+-\d+\) +([\d.]+)$", proc.stdout, re.M))
    assert set(found) == set(passes) and found["memcpy"] == "1.00", proc.stdout
    assert list(tmp_path.iterdir()) == []
