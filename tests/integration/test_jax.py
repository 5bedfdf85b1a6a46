"""``layoutckpt.jax``: a checkpoint saved by PyTorch ranks loads as JAX arrays under any sharding.

Four real gloo ranks save a state under a dp x tp layout; JAX then loads it on 8 CPU devices
under other shardings. Every device's shard is compared bit for bit with the full array, and
TensorStore's file counter (as in ``test_read_amplification``) shows that every inner chunk the
devices need is read once, replicas and neighbouring boxes sharing it, and, in a job of two JAX
processes, that each process reads only its own devices' chunks.

JAX fixes its number of CPU devices when its backend starts, so this module asks for 8 as it is
imported: pytest imports every test module before it runs any test, so this comes first even
when the whole suite shares one process (the docs' JAX page then runs on 8 devices too).

The module imports without torch (torch is imported by the saving ranks only), so the JAX
processes import it with torch made unimportable, which shows ``layoutckpt.jax`` needs none.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as JP

import layoutckpt as lc
import layoutckpt.jax as lcj
from tests.support.counters import bytes_read
from tests.support.paths import REPO

DEVICES = 8
try:
    jax.config.update("jax_num_cpu_devices", DEVICES)
except RuntimeError:
    pass  # the backend had already started: the `cpus` fixture says whether it has enough devices

SAVE_MESH = {"dp": 2, "tp": 2}
SAVE_RULES = [
    (r"embed$", lc.P(("dp", "tp"))),
    (r"\.wq$", lc.P(None, "tp")),
    (r"\.wo$", lc.P("tp", None)),
    (r".*", lc.P()),
]
VALUES = {"step": 7, "name": "tiny", "lr": 0.5}


def full_arrays() -> dict[str, np.ndarray]:
    """The global arrays, made with NumPy (bfloat16 by ml_dtypes), so no expectation needs torch."""
    rng = np.random.default_rng(0)

    def normal(*shape: int, dtype: object = np.float32) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    return {
        "model.embed": normal(64, 48),
        "model.layers.0.wq": normal(32, 64, dtype=ml_dtypes.bfloat16),
        "model.layers.0.wo": normal(64, 32),
        "model.norm": normal(48, dtype=ml_dtypes.bfloat16),
        "model.scale": np.array(0.25, dtype=np.float32),
        "model.count": np.arange(8, dtype=np.int64) * 3,
    }


def _save_from_torch(rank, group, path):
    """One rank of a dp x tp job saves its torch.chunk pieces; lm_head is tied to the embedding."""
    import torch

    from tests.support.oracle import local_shard

    layout = lc.Layout(lc.Mesh(SAVE_MESH), SAVE_RULES)
    local = {}
    for name, full in full_arrays().items():
        bits = full.view(np.int16) if full.dtype == ml_dtypes.bfloat16 else full
        tensor = torch.from_numpy(bits.copy())
        tensor = tensor.view(torch.bfloat16) if full.dtype == ml_dtypes.bfloat16 else tensor
        spec = layout.spec_for(name).padded(full.ndim)
        local[name.removeprefix("model.")] = local_shard(tensor, spec, SAVE_MESH, rank).clone()
    layers = {"0": {"wq": local.pop("layers.0.wq"), "wo": local.pop("layers.0.wo")}}
    state = {"model": {**local, "layers": layers}, "lm_head": local["embed"], **VALUES}
    lc.save(path, state, layout, group=group, inner_chunk_bytes=1024)


@pytest.fixture(scope="module")
def cpus() -> list[jax.Device]:
    devices = jax.devices("cpu")
    if len(devices) < DEVICES:
        pytest.fail(
            f"JAX started with {len(devices)} CPU device(s) before tests/integration/test_jax.py "
            f"could ask for {DEVICES}; run this file in its own pytest process"
        )
    return devices[:DEVICES]


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("jax") / "ck")
    ranks.run(_save_from_torch, 4, path)
    return path


FULL = {**full_arrays(), "lm_head": full_arrays()["model.embed"]}


def grid(cpus) -> Mesh:
    return Mesh(np.array(cpus).reshape(4, 2), ("x", "y"))


def line(cpus) -> Mesh:
    return Mesh(np.array(cpus), ("d",))


# ----------------------------------------------------------------------------- the tests' own accounts


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits, so bfloat16 values compare exactly."""
    return a.view(f"u{a.dtype.itemsize}")


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else k
        out.update(leaves(v, name) if isinstance(v, dict) else {name: v})
    return out


def spec_for(rules, name: str) -> JP:
    return next(spec for pattern, spec in rules if re.search(pattern, name))


def device_boxes(shape, spec, mesh: Mesh, process: int | None = None) -> set[tuple[tuple[int, int], ...]]:
    """The distinct blocks of the devices (of ``process``, or all) under an even split, from the
    spec and mesh coordinates alone, not from JAX's index map."""
    axes = dict(mesh.shape)
    boxes = set()
    for coords in itertools.product(*(range(n) for n in axes.values())):
        if process is not None and mesh.devices[coords].process_index != process:
            continue
        at = dict(zip(axes, coords))
        box = []
        for dim, n in enumerate(shape):
            entry = spec[dim] if dim < len(spec) else None
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            k, i = 1, 0
            for a in names:
                k, i = k * axes[a], i * axes[a] + at[a]
            box.append((i * n // k, (i + 1) * n // k))
        boxes.add(tuple(box))
    return boxes


def chunk_bytes(info: lc.ArrayInfo, boxes) -> int:
    """Stored bytes of every inner chunk some box overlaps, once each, with their crc32c, plus
    the index of every shard holding one (16 bytes per inner chunk + crc32c), once each."""
    shard, inner = info.shard_shape, info.inner_chunk_shape
    chunks = set()
    for box in boxes:
        chunks.update(itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(box, inner))))
    shards = {tuple(i * c // s for i, c, s in zip(cell, inner, shard)) for cell in chunks}
    per_chunk = info.dtype.itemsize * math.prod(inner) + 4
    per_index = 16 * math.prod(s // c for s, c in zip(shard, inner)) + 4 + 32  # and the binding block
    return len(chunks) * per_chunk + len(shards) * per_index


def expected_bytes(path: str, rules, mesh: Mesh, names, process: int | None = None) -> int:
    """What loading ``names`` under ``rules`` must read: per stored array (names tied at save time
    share one), the chunks of the union of the devices' boxes."""
    rd = lc.open(path)
    boxes: dict[str, set] = {}
    for name in names:
        stored = rd.aliases.get(name, name)
        boxes.setdefault(stored, set()).update(device_boxes(rd.info(name).shape, spec_for(rules, name), mesh, process))
    return sum(chunk_bytes(rd.info(stored), b) for stored, b in boxes.items())


def check_array(got: jax.Array, want: np.ndarray, sharding) -> None:
    assert got.shape == want.shape
    assert got.dtype == jax.dtypes.canonicalize_dtype(want.dtype)
    assert got.sharding == sharding
    assert {s.device for s in got.addressable_shards} == set(sharding.addressable_devices)
    for shard in got.addressable_shards:
        expect = want[shard.index].astype(got.dtype)
        assert np.array_equal(bits(np.asarray(shard.data)), bits(expect)), (shard.device, shard.index)


# ----------------------------------------------------------------------------- torch -> JAX


# Rules for the JAX side, on a (4, 2) grid ("x", "y") or a line ("d",) of 8 devices.
CASES = {
    "x_y": ("grid", [(r"embed$|\.wo$", JP("x", "y")), (r"\.wq$", JP(None, "y")), (r".*", JP())]),
    "y_x": ("grid", [(r"embed$|\.wq$", JP("y", "x")), (r"norm$|count$", JP("x")), (r".*", JP())]),
    "xy_rows": ("grid", [(r"embed$|lm_head$", JP(("x", "y"))), (r"\.w[qo]$", JP(None, ("y", "x"))), (r".*", JP())]),
    "line": ("line", [(r"\.w[qo]$", JP(None, "d")), (r"embed$|norm$|count$", JP("d")), (r".*", JP())]),
    "replicated": ("grid", [(r".*", JP())]),
}


@pytest.mark.parametrize("case", CASES)
def test_torch_checkpoint_loads_bit_exact_under_jax_shardings_reading_each_chunk_once(saved, cpus, case):
    which, rules = CASES[case]
    mesh = grid(cpus) if which == "grid" else line(cpus)

    before = bytes_read()
    out = lcj.load(saved, rules, mesh=mesh)
    fetched = bytes_read() - before

    assert {k: out[k] for k in VALUES} == VALUES
    arrays = leaves({k: v for k, v in out.items() if k not in VALUES})
    assert sorted(arrays) == sorted(FULL)
    for name, got in arrays.items():
        check_array(got, FULL[name], NamedSharding(mesh, spec_for(rules, name)))
    if spec_for(rules, "lm_head") == spec_for(rules, "model.embed"):
        assert out["lm_head"] is out["model"]["embed"]  # tied at save time, one array in JAX too
    # Eight devices, many of them holding the same or neighbouring boxes: still every chunk once.
    assert fetched == expected_bytes(saved, rules, mesh, FULL)


# Process 0's devices are x = 0, 1 of the grid, so it holds rows 0:32 of every matrix; process 1 the rest.
PROCESS_RULES = [(r"embed$|lm_head$|\.w[qo]$", JP("x", "y")), (r".*", JP())]


def _jax_process(process: int, port: int, path: str) -> None:
    """One of two JAX processes of 4 CPU devices each, on a (4, 2) grid of all 8: load, check
    every shard this process holds, and print the bytes it read and the bytes it had to."""
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)
    try:
        assert "torch" not in sys.modules or sys.modules["torch"] is None
        mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
        rules = PROCESS_RULES
        before = bytes_read()
        out = lcj.load(path, rules, mesh=mesh)
        fetched = bytes_read() - before
        arrays = leaves({k: v for k, v in out.items() if k not in VALUES})
        for name, got in arrays.items():
            assert len(got.addressable_shards) == 4
            check_array(got, FULL[name], NamedSharding(mesh, spec_for(rules, name)))
        expected = expected_bytes(path, rules, mesh, FULL, process)
        print(json.dumps({"fetched": fetched, "expected": expected, "all": expected_bytes(path, rules, mesh, FULL)}))
    finally:
        jax.distributed.shutdown()


def test_each_jax_process_reads_only_its_devices_chunks_without_torch(saved):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    code = (
        "import sys; sys.modules['torch'] = None; "
        "from tests.integration.test_jax import _jax_process; _jax_process({}, {}, {!r})"
    )
    # CPU only, whatever accelerators the machine has; jax_num_cpu_devices sets the count.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code.format(p, port, saved)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(2)
    ]
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:  # the other process of a failed pair waits for its peer forever
                p.kill()
                p.wait()
    for report in reports:
        assert report["fetched"] == report["expected"]
        # Each process holds half of every matrix, and the matrices are most of the bytes.
        assert report["expected"] < 0.6 * report["all"]


# ----------------------------------------------------------------------------- the forms of shardings=


def test_every_form_of_shardings_gives_the_same_arrays(saved, cpus):
    mesh = grid(cpus)
    rules = CASES["x_y"][1]
    want = {n: NamedSharding(mesh, spec_for(rules, n)) for n in FULL}
    lc_rules = lc.Layout(lc.Mesh({"x": 4, "y": 2}), [(p, lc.P(*s)) for p, s in rules]).spec_rules
    forms = {
        "mapping": want,
        "mapping of specs": {n: spec_for(rules, n) for n in FULL},
        "callable": lambda name, info: want[name],
        "layoutckpt rules": lc_rules,
    }
    for shardings in forms.values():
        out = leaves(lcj.load(saved, shardings, mesh=mesh))
        for name in FULL:
            check_array(out[name], FULL[name], want[name])

    # One sharding for every array; a spec stands for NamedSharding(mesh, spec).
    for shardings, mesh_arg in [(NamedSharding(mesh, JP()), None), (JP(), mesh), (lc.P(), mesh)]:
        out = leaves(lcj.load(saved, shardings, mesh=mesh_arg))
        for name in FULL:
            check_array(out[name], FULL[name], NamedSharding(mesh, JP()))

    # The callable sees the stored shape and dtype.
    seen = {}

    def by_info(name, info):
        seen[name] = (info.shape, info.dtype)
        return JP("x") if len(info.shape) == 2 else JP()

    out = leaves(lcj.load(saved, by_info, mesh=mesh))
    assert seen == {n: (a.shape, a.dtype) for n, a in FULL.items()}
    check_array(out["model.layers.0.wq"], FULL["model.layers.0.wq"], NamedSharding(mesh, JP("x")))


def test_select_loads_only_those_arrays_and_values_come_back_as_python(saved, cpus):
    mesh = grid(cpus)
    rules = CASES["y_x"][1]
    before = bytes_read()
    out = lcj.load(saved, rules, mesh=mesh, select=r"^model\.layers\.")
    fetched = bytes_read() - before
    assert list(out) == ["model"] and list(out["model"]) == ["layers"]
    assert sorted(out["model"]["layers"]["0"]) == ["wo", "wq"]
    assert fetched == expected_bytes(saved, rules, mesh, ["model.layers.0.wq", "model.layers.0.wo"])

    # A mapping needs entries for the selected arrays only.
    out = lcj.load(saved, {"model.norm": JP("x")}, mesh=mesh, select=["model.norm", "step", "name", "lr"])
    assert {k: out[k] for k in VALUES} == VALUES
    assert type(out["step"]) is int and type(out["lr"]) is float
    check_array(out["model"]["norm"], FULL["model.norm"], NamedSharding(mesh, JP("x")))


def test_load_array_from_a_path_or_a_reader(saved, cpus):
    mesh = grid(cpus)
    got = lcj.load_array(saved, "model.layers.0.wo", JP(None, "y"), mesh=mesh)
    check_array(got, FULL["model.layers.0.wo"], NamedSharding(mesh, JP(None, "y")))
    with lc.open(saved) as rd:
        one = SingleDeviceSharding(cpus[3])
        check_array(lcj.load_array(rd, "lm_head", one), FULL["lm_head"], one)  # a tied name
        everywhere = NamedSharding(mesh, JP())
        check_array(lcj.load_array(rd, "model.scale", everywhere), FULL["model.scale"], everywhere)  # 0-d


def test_each_array_is_placed_once_its_boxes_are_read(saved, cpus, monkeypatch):
    """With a budget of 2 KiB in flight, every matrix box is read on its own, and each array goes
    to its devices (and its host buffers away) as soon as its boxes are in, one at a time."""
    placed = []
    real_wait = jax.block_until_ready

    def wait(arrays):  # once per array, right after it is placed
        placed.append(len(arrays))
        return real_wait(arrays)

    monkeypatch.setattr(jax, "block_until_ready", wait)
    mesh = grid(cpus)
    out = leaves(lcj.load(saved, CASES["replicated"][1], mesh=mesh, io=lc.IOConfig(budget_bytes=2048)))
    for name in FULL:
        check_array(out[name], FULL[name], NamedSharding(mesh, JP()))
    stored = lc.open(saved)
    assert placed == [1] * (len(stored.keys()))


def test_a_placed_arrays_host_memory_is_freed_before_the_next_is_placed(saved, cpus, monkeypatch):
    """Nothing of layoutckpt's (the read engine's requests and batches included) holds the
    host array of a stored array once it is placed: the host holds about one array at a time,
    never the whole checkpoint. (The placement here hands JAX nothing: what JAX keeps of its
    source for a while is JAX's.)"""
    import weakref

    hosts: list[tuple[str, weakref.ref]] = []

    def place(plan, region, host):
        alive = [stored for stored, ref in hosts if stored != plan.stored and ref() is not None]
        assert not alive, f"host arrays of {alive} outlive their placement"
        hosts.append((plan.stored, weakref.ref(host)))
        return jax.numpy.zeros(())

    monkeypatch.setattr(lcj, "_place", place)
    lcj.load(saved, CASES["replicated"][1], mesh=grid(cpus), io=lc.IOConfig(budget_bytes=2048))
    assert len({stored for stored, _ in hosts}) == len(lc.open(saved).keys())


def test_checkpoints_on_object_stores_load_too(cpus):
    # jax.make_mesh gives a mesh of explicit axes; memory:// stands for s3:// and gs://.
    mesh = jax.make_mesh((4, 2), ("x", "y"), devices=cpus)
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    lc.save("memory://test-jax/ck", {"w": w, "n": 3})
    out = lcj.load("memory://test-jax/ck", [(r"^w$", JP("x", "y")), (r".*", JP())], mesh=mesh)
    assert out["n"] == 3
    check_array(out["w"], w, NamedSharding(mesh, JP("x", "y")))


# ----------------------------------------------------------------------------- dtypes


def test_int64_loads_as_int32_unless_x64_and_never_wraps(saved, cpus, tmp_path):
    one = SingleDeviceSharding(cpus[0])
    got = lcj.load_array(saved, "model.count", one)
    assert got.dtype == np.int32 and np.array_equal(np.asarray(got), FULL["model.count"])

    path = str(tmp_path / "big")
    lc.save(path, {"big": np.array([1, 2**40], dtype=np.int64), "f": np.array([0.1], dtype=np.float64)})
    with pytest.raises(lc.TemplateMismatchError, match=r"'big'.*jax_enable_x64"):
        lcj.load_array(path, "big", one)
    assert lcj.load_array(path, "f", one).dtype == np.float32  # as jnp.asarray makes it
    jax.config.update("jax_enable_x64", True)
    try:
        big = lcj.load_array(path, "big", one)
        assert big.dtype == np.int64 and int(big[1]) == 2**40
    finally:
        jax.config.update("jax_enable_x64", False)


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_array_and_the_fix_before_reading(saved, cpus, tmp_path):
    mesh = grid(cpus)
    before = bytes_read()
    with pytest.raises(lc.CheckpointNotFoundError):
        lcj.load(str(tmp_path / "nothing"), JP(), mesh=mesh)
    with pytest.raises(lc.LayoutError, match=r"\['model\.nope'\].*keys\(\)"):
        lcj.load(saved, {"model.nope": JP(), **dict.fromkeys(FULL, JP())}, mesh=mesh)
    with pytest.raises(lc.LayoutError, match=r"'model\.norm' has no entry.*select="):
        lcj.load(saved, {n: JP() for n in FULL if n != "model.norm"}, mesh=mesh)
    with pytest.raises(lc.LayoutError, match=r"'model\.norm': no sharding rule.*catch-all"):
        lcj.load(saved, [(r"embed|\.w|lm_head|scale|count", JP())], mesh=mesh)
    with pytest.raises(lc.LayoutError, match=r"'model\.embed' of shape \(64, 48\).*divides"):
        lcj.load(saved, JP("t"), mesh=Mesh(np.array(cpus[:3]), ("t",)), select=["model.embed"])
    with pytest.raises(lc.LayoutError, match=r"'model\.norm'.*3 entries for 1 dimension"):
        lcj.load(saved, [(r"norm", JP(None, None, "x")), (r".*", JP())], mesh=mesh)
    with pytest.raises(lc.LayoutError, match=r"'model\.embed'.*no mesh="):
        lcj.load(saved, JP("x"))
    with pytest.raises(lc.LayoutError, match=r"jax\.sharding\.Mesh"):
        lcj.load(saved, JP(), mesh=lc.Mesh({"x": 8}))
    with pytest.raises(lc.LayoutError, match=r"'model\.embed'.*got str"):
        lcj.load(saved, lambda name, info: "x", mesh=mesh)
    with pytest.raises(TypeError, match="shardings= must be"):
        lcj.load(saved, 3, mesh=mesh)
    with pytest.raises(KeyError, match=r"model\.nope"):
        lcj.load(saved, JP(), mesh=mesh, select=["model.nope"])
    with pytest.raises(KeyError, match=r"no array 'model\.nope'"):
        lcj.load_array(saved, "model.nope", JP(), mesh=mesh)
    assert bytes_read() == before


def test_a_damaged_chunk_raises_an_integrity_error_naming_the_array(saved, cpus, tmp_path):
    path = tmp_path / "damaged"
    shutil.copytree(saved, path)
    shard = path / "model" / "layers" / "0" / "wo" / "c.0.0"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(lc.IntegrityError, match=r"'model\.layers\.0\.wo'"):
        lcj.load(str(path), JP(), mesh=grid(cpus))
