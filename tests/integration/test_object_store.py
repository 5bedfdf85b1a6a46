"""Checkpoints on object stores: ``s3://`` against a real S3-protocol server on loopback (moto's
standalone server, started and stopped here), and ``memory://``.

The S3 cases run as a job would: 2 gloo ranks save, 4 ranks load under another mesh, one plain
process reads a slice, and a process killed just before the commit leaves nothing a reader takes
for a checkpoint. Endpoint, region and credentials come from the usual AWS variables.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
import tensorstore as ts
import torch

import layoutckpt as lc
from layoutckpt.storage import _location
from layoutckpt.storage._location import PENDING, KvPrefix, locate
from tests.support.s3server import running

BUCKET = "ckpts"
FULL_W = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8)
FULL_E = torch.arange(8 * 4, dtype=torch.bfloat16).reshape(8, 4)


@pytest.fixture(scope="module")
def s3():
    with running(BUCKET) as server:
        yield server


def _url() -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}/step_1"


def _keys(url: str) -> list[str]:
    loc = locate(url)
    assert isinstance(loc, KvPrefix)
    return loc.keys()


# -- ranks ---------------------------------------------------------------------------------


def _save_2(rank, group, url, env, fail_rank=None):
    os.environ.update(env)  # the pool's processes started before the server did
    mesh = lc.Mesh({"tp": 2})
    layout = lc.Layout(mesh, [(r"\.w$", lc.P("tp", None)), (r"\.e$", lc.P(None, "tp")), (r".*", lc.P())])
    state = {"m": {"w": FULL_W.chunk(2)[rank], "e": FULL_E.chunk(2, dim=1)[rank], "b": torch.ones(3)}, "step": 7}
    if fail_rank == rank:
        state["m"]["w"] = torch.zeros(6, 7)  # a shard of the wrong shape: the save must refuse
    fut = lc.save_async(url, state, layout, group=group, metadata={"job": "s3"}, rank_state={"rank": rank})
    return fut.result().bytes_written


def _load_4(rank, group, url, env):
    os.environ.update(env)
    mesh = lc.Mesh({"dp": 2, "tp": 2})
    layout = lc.Layout(mesh, [(r"\.w$", lc.P(None, "tp")), (r"\.e$", lc.P(("dp", "tp"))), (r".*", lc.P())])
    out = lc.load(url, layout, group=group)
    c = mesh.coords(rank)
    assert torch.equal(out["m"]["w"], FULL_W.chunk(2, dim=1)[c["tp"]])
    assert torch.equal(out["m"]["e"].view(torch.int16), FULL_E.chunk(4)[rank].view(torch.int16))
    assert torch.equal(out["m"]["b"], torch.ones(3))
    assert out["step"] == 7
    return True


def test_s3_save_from_2_ranks_reshard_load_on_4_and_partial_read(ranks, s3):
    url = _url()
    written = ranks.run(_save_2, 2, url, s3.env)
    assert sum(written) == FULL_W.numel() * 4 + FULL_E.numel() * 2 + 3 * 4  # a replica is written once
    assert ranks.run(_load_4, 4, url, s3.env) == [True] * 4

    # One plain process, no torch.distributed: a slice of one tensor.
    with lc.open(url) as rd:
        assert rd.metadata == {"job": "s3"}
        np.testing.assert_array_equal(rd.read("m.w", np.s_[3:7, 2:5]), FULL_W[3:7, 2:5].numpy())
        assert rd.rank_states() == [{"rank": 0}, {"rank": 1}]
    # The committed prefix holds the marker and no pending object.
    keys = _keys(url)
    assert "zarr.json" in keys and PENDING not in keys
    assert any(k.startswith("m/w/c.") for k in keys)


def test_s3_checkpoint_is_plain_zarr_for_tensorstore(s3):
    """Open: TensorStore alone reads an array back from S3, with no layoutckpt code."""
    url = _url()
    x = np.random.default_rng(0).standard_normal((33, 17)).astype(np.float32)
    lc.save(url, {"x": x})
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "s3", "bucket": bucket, "path": f"{prefix}/x/", "endpoint": s3.endpoint},
    }
    arr = ts.open(spec, open=True).result()
    np.testing.assert_array_equal(arr.read().result(), x)


def test_s3_failed_save_on_one_rank_leaves_nothing(ranks, s3):
    url = _url()
    with pytest.raises(Exception, match="shape"):
        ranks.run(_save_2, 2, url, s3.env, 1)
    with pytest.raises(lc.CheckpointNotFoundError):
        lc.open(url)
    # Refused before any array was written; at most the claim on the prefix remains, and the
    # next save may take the prefix.
    assert set(_keys(url)) <= {PENDING}
    assert sum(ranks.run(_save_2, 2, url, s3.env)) > 0
    assert lc.open(url).step is None


_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, numpy as np, layoutckpt as lc
    from layoutckpt.storage._location import KvPrefix

    def die(self, staging, marker, *, overwrite, save_id):  # every array is written; the marker is next
        os.kill(os.getpid(), signal.SIGKILL)

    KvPrefix.commit = die
    lc.save({url!r}, {{"x": np.arange(4096, dtype=np.float32).reshape(64, 64), "y": np.ones(5)}})
    """
)


def test_s3_kill_before_commit_leaves_checkpoint_invisible(s3):
    url = _url()
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE.format(url=url)], env={**os.environ, **s3.env}, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    keys = _keys(url)
    assert any(k.startswith("x/c.") for k in keys), keys  # the data really is there...
    assert "zarr.json" not in keys and PENDING in keys
    with pytest.raises(lc.CheckpointNotFoundError, match="unfinished save"):  # ...but it is no checkpoint
        lc.open(url)
    with pytest.raises(lc.CheckpointNotFoundError):
        lc.load(url)
    # A new save takes over the prefix: the stale objects go, the new checkpoint commits.
    lc.save(url, {"z": np.full(3, 2.0)})
    with lc.open(url) as rd:
        assert rd.keys() == ["z"]
        np.testing.assert_array_equal(rd.read("z"), np.full(3, 2.0))
    assert not any(k.startswith(("x/", "y/")) for k in _keys(url))


def test_s3_refuses_to_replace_or_take_over(s3):
    url = _url()
    lc.save(url, {"x": np.arange(3.0)})
    with pytest.raises(lc.CheckpointExistsError, match="overwrite=True"):
        lc.save(url, {"x": np.arange(4.0)})
    with pytest.raises(lc.CheckpointExistsError, match="no atomic rename"):
        lc.save(url, {"x": np.arange(4.0)}, overwrite=True)
    np.testing.assert_array_equal(lc.open(url).read("x"), np.arange(3.0))

    # Objects that are not ours are never deleted.
    other = _url()
    locate(other).write("notes.txt", b"mine")
    with pytest.raises(lc.CheckpointExistsError, match="not a layoutckpt checkpoint"):
        lc.save(other, {"x": np.arange(3.0)})
    assert _keys(other) == ["notes.txt"]


# -- memory:// and the path forms -------------------------------------------------------------


def test_memory_store_round_trip_within_a_process():
    url = f"memory://lc-{uuid.uuid4().hex[:8]}/ck"
    x = torch.randn(40, 24)
    lc.save(url, {"x": x, "n": 3}, metadata={"k": 1})
    out = lc.load(url)
    assert torch.equal(out["x"], x) and out["n"] == 3
    assert lc.open(url).read("x", np.s_[5:9]).tobytes() == x[5:9].numpy().tobytes()
    with pytest.raises(lc.CheckpointNotFoundError):
        lc.open(f"memory://lc-{uuid.uuid4().hex[:8]}/none")


def test_path_forms():
    assert locate("s3://b/a/b/").kvstore("x") == {"driver": "s3", "bucket": "b", "path": "a/b/x/"} | (
        {"endpoint": os.environ["AWS_ENDPOINT_URL_S3"]} if "AWS_ENDPOINT_URL_S3" in os.environ else {}
    ) | ({"aws_region": os.environ["AWS_REGION"]} if "AWS_REGION" in os.environ else {})
    assert locate("gs://bucket/run/step_3").kvstore("m/w") == {
        "driver": "gcs",
        "bucket": "bucket",
        "path": "run/step_3/m/w/",
    }
    assert locate("memory://a").kvstore() == {"driver": "memory", "path": "a/"}
    assert locate({"driver": "memory", "path": "q"}).url == "memory://q"
    assert locate("file:///tmp/x").kvstore()["driver"] == "file"
    with pytest.raises(ValueError, match="unsupported storage 'ftp://'"):
        locate("ftp://host/x")
    with pytest.raises(ValueError, match="names no bucket"):
        locate("s3:///x")


def test_manager_on_s3_lists_retains_and_resumes(s3):
    from layoutckpt._retention import collect_garbage

    root = f"s3://{BUCKET}/mgr-{uuid.uuid4().hex[:8]}"
    with lc.CheckpointManager(root, keep_last=2) as mgr:
        assert mgr.root == root and mgr.steps() == []
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((4, 4), float(step))}, metadata={"step": step})
        mgr.wait()
        assert mgr.steps() == [2, 3]
        assert mgr.path(3) == f"{root}/step_00000003"
    assert not _keys(f"{root}/step_00000001")  # retired: every object gone

    # A save killed before its commit leaves a prefix that is not listed...
    locate(f"{root}/step_00000004").prepare()
    locate(f"{root}/step_00000004").write("w/zarr.json", b"{}")
    mgr = lc.CheckpointManager(root, keep_last=2, async_save=False)
    assert mgr.steps() == [2, 3] and mgr.latest_step() == 3
    assert torch.equal(mgr.load()["w"], torch.full((4, 4), 3.0))
    assert mgr.metadata() == {"step": 3}
    # ...and the step can be saved again.
    mgr.save(4, {"w": torch.full((4, 4), 4.0)})
    mgr.close()
    assert lc.CheckpointManager(root).steps() == [3, 4]

    assert collect_garbage(root, keep_last=1, dry_run=True) == [3]
    assert collect_garbage(root, keep_last=1) == [3]
    assert lc.CheckpointManager(root).steps() == [4]


def test_request_concurrency_and_retries_are_configurable(monkeypatch, tmp_path):
    from layoutckpt.storage import _store

    spec = _store.context(concurrency=8, retries=3).spec.to_json()
    for driver in ("s3", "gcs"):
        assert spec[f"{driver}_request_concurrency"] == {"limit": 8}
        assert spec[f"{driver}_request_retries"]["max_retries"] == 3
    assert spec["file_io_concurrency"] == {"limit": 8}
    # The io= of a reader reaches the stores it opens; LAYOUTCKPT_MAX_RETRIES sets the default.
    monkeypatch.setenv("LAYOUTCKPT_MAX_RETRIES", "5")
    assert lc.IOConfig().retries == 5
    url = tmp_path / "ck"
    lc.save(url, {"x": np.arange(5)}, io=lc.IOConfig(concurrency=4))
    with lc.open(url, io=lc.IOConfig(concurrency=4, retries=2)) as rd:
        context = rd.tensorstore("x").spec(retain_context=True).to_json()["context"]
        assert context["file_io_concurrency"] == {"limit": 4}
    assert _store.context(retries=None).spec.to_json()["s3_request_retries"]["max_retries"] == 5


def test_a_pending_marker_that_cannot_be_dropped_leaves_the_commit(monkeypatch, caplog):
    """The commit marker is stored: a failure to delete the pending marker after it must not
    make the save delete the checkpoint it has just committed."""
    url = f"memory://pend-{uuid.uuid4().hex[:8]}/ck"

    def refuse(self):
        raise ValueError("PERMISSION_DENIED: injected")

    monkeypatch.setattr(KvPrefix, "drop_pending", refuse)
    lc.save(url, {"w": np.arange(4)})
    assert lc.load(url)["w"].tolist() == [0, 1, 2, 3]
    assert "is committed, but its pending marker stays" in caplog.text


def test_a_retire_that_fails_midway_leaves_the_step_listed(monkeypatch):
    """The pending marker is written before the commit marker goes: a failure between them
    leaves the checkpoint committed (listed, retired again later), never a prefix of objects
    that is neither a checkpoint nor an unfinished save, which blocks a new save of the step."""
    root = f"memory://ret-{uuid.uuid4().hex[:8]}/run"
    mgr = lc.CheckpointManager(root, async_save=False)
    mgr.save(1, {"w": np.arange(3)})
    real_write = KvPrefix.write

    def write(self, key, data):
        if key == PENDING:
            raise ValueError("PERMISSION_DENIED: injected")
        real_write(self, key, data)

    monkeypatch.setattr(KvPrefix, "write", write)
    with pytest.raises(ValueError, match="injected"):
        mgr.delete(1)
    monkeypatch.undo()
    assert mgr.steps() == [1] and lc.load(mgr.path(1))["w"].tolist() == [0, 1, 2]
    mgr.delete(1)
    mgr.save(1, {"w": np.arange(2)})
    assert mgr.steps() == [1]


def test_a_manager_on_a_kvstore_spec_keeps_every_member_of_it(s3, monkeypatch):
    """An endpoint given only in the spec: each step's location carries it, not a URL that
    would resolve the endpoint from the environment."""
    spec = {"driver": "s3", "bucket": BUCKET, "path": f"spec-{uuid.uuid4().hex[:8]}", "endpoint": s3.endpoint}
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with lc.CheckpointManager(spec, async_save=False) as mgr:
        mgr.save(3, {"w": np.arange(5)})
        assert mgr.steps() == [3]
        assert mgr.path(3)["endpoint"] == s3.endpoint
        assert mgr.load()["w"].tolist() == list(range(5))
        mgr.delete(3)
        assert mgr.steps() == []


def test_a_document_past_its_limit_is_refused_from_one_byte(s3):
    """The byte past the limit is read first: a document past it is refused without being
    downloaded; one at the limit, or missing, reads as before."""
    loc = locate(_url())
    loc.write("doc.json", b"x" * 10)
    assert loc.read("doc.json", max_bytes=10) == b"x" * 10
    assert loc.read("absent.json", max_bytes=10) is None
    ranges = []
    real_read = ts.KvStore.read

    class Spy:
        def __init__(self, kv):
            self.kv = kv

        def read(self, key, **kw):
            ranges.append(kw.get("byte_range"))
            return real_read(self.kv, key, **kw)

    with pytest.raises(OSError, match="more than 9 bytes"):
        _location.read_bounded(Spy(loc._kv), "doc.json", 9)
    assert ranges == [slice(9, 10)]  # never the whole value
