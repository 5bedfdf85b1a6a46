"""Bad input: every case raises a typed error naming the array, the expectation and the fix,
before anything is written, and leaves the directory (and any checkpoint already in it) as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import layoutckpt as lc

# --- helpers -----------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every directory (None) and file (its bytes) under ``root``, by relative path."""
    out: dict[str, bytes | None] = {}
    for dirpath, _, filenames in os.walk(root):
        out[os.path.relpath(dirpath, root) + "/"] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


W = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) / 7
B = torch.linspace(-1, 1, 5).to(torch.bfloat16)


def good_state() -> dict:
    return {"model": {"w": W.clone(), "b": B.clone()}, "step": 7, "name": "run"}


def save_good(path: Path) -> None:
    lc.save(path, good_state(), lc.Layout.replicated())


def assert_good(path: Path) -> None:
    """The good checkpoint still loads, bit-exact."""
    out = lc.load(path)
    assert out["model"]["w"].dtype == torch.float32 and torch.equal(
        out["model"]["w"].view(torch.int32), W.view(torch.int32)
    )
    assert out["model"]["b"].dtype == torch.bfloat16 and torch.equal(
        out["model"]["b"].view(torch.int16), B.view(torch.int16)
    )
    assert out["step"] == 7 and out["name"] == "run"


def assert_mentions(err: BaseException | str, *fragments: str) -> None:
    text = err if isinstance(err, str) else str(err)
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in message: {text}"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A parent directory holding a committed good checkpoint at ``root / 'good'``."""
    save_good(tmp_path / "good")
    return tmp_path


def refuse_save(root: Path, state, layout: lc.Layout, exc: type[BaseException], *fragments: str) -> None:
    """Saving ``state`` raises ``exc`` (message holding ``fragments``) both onto the good checkpoint
    with overwrite=True and to a new path, and changes nothing on disk."""
    before = snapshot(root)
    for target, overwrite in ((root / "good", True), (root / "new", False), (root / "nested" / "new", True)):
        with pytest.raises(exc) as info:
            lc.save(target, state, layout, overwrite=overwrite)
        assert_mentions(info.value, *fragments)
    assert snapshot(root) == before
    assert_good(root / "good")


MESH1 = lc.Mesh({"dp": 1, "tp": 1})


def layout1(*rules) -> lc.Layout:
    return lc.Layout(MESH1, [*rules, (r".*", lc.P())])


# --- layout problems, single process -----------------------------------------------------------


def test_unknown_mesh_axis_is_refused_by_the_layout():
    with pytest.raises(lc.LayoutError) as info:
        lc.Layout(MESH1, [(r"\.w$", lc.P("model", None))])
    assert_mentions(info.value, r"'\\.w$'", "'model'", "use one of ['dp', 'tp']")


def test_axis_used_twice():
    # Refused when the spec is built, whatever the mesh: before any layout, save or load.
    for entries, shown in (
        (("tp", "tp"), "P('tp', 'tp')"),
        ((("tp", "tp"),), "P(('tp', 'tp'))"),
        ((("dp", "tp"), "dp"), "P(('dp', 'tp'), 'dp')"),
    ):
        with pytest.raises(lc.LayoutError) as info:
            lc.P(*entries)
        axis = "'tp'" if shown.count("'tp'") == 2 else "'dp'"
        assert_mentions(info.value, shown, f"axis {axis} twice", "at most one dimension")


def test_spec_longer_than_rank(root):
    refuse_save(
        root,
        good_state(),
        layout1((r"\.b$", lc.P(None, "tp"))),
        lc.LayoutError,
        "'model.b'",
        "(5,)",
        "P(None, 'tp')",
        "only 1 dimension",
        "shorten the spec",
    )
    scalar = {"s": torch.tensor(3.0)}
    refuse_save(root, scalar, layout1((r"^s$", lc.P("tp"))), lc.LayoutError, "'s'", "only 0 dimension", "shorten")


def test_no_rule_matches(root):
    layout = lc.Layout(MESH1, [(r"\.w$", lc.P("tp"))])
    refuse_save(root, good_state(), layout, lc.LayoutError, "'model.b'", "no layout rule matches", "catch-all")


def test_mesh_size_differs_from_world_size_single_process(root):
    layout = lc.Layout(lc.Mesh({"tp": 2}), [(r".*", lc.P())])
    refuse_save(
        root, good_state(), layout, lc.WorldSizeError, "Mesh({'tp': 2})", "2 devices", "1 ranks", "multiply to 1"
    )
    with pytest.raises(lc.WorldSizeError, match="multiply to 1"):
        lc.load(root / "good", layout)


def test_layout_rule_parse_errors():
    with pytest.raises(lc.LayoutError) as info:
        lc.Layout(MESH1, [(r"\.w$", lc.P()), (r"(unclosed", lc.P())])
    assert_mentions(info.value, "rule #1", "'(unclosed'", "not a valid regex")
    for spec in (("tp", None), "P('tp')", None):
        with pytest.raises(lc.LayoutError) as info:
            lc.Layout(MESH1, [(r"\.w$", spec)])
        assert_mentions(info.value, "rule #0", r"'\\.w$'", "must be a P(...)")
    with pytest.raises(lc.LayoutError, match="must be a string"):
        lc.Layout(MESH1, [(3, lc.P())])
    with pytest.raises(lc.LayoutError, match=r"\(pattern, P\(...\)\) pair"):
        lc.Layout(MESH1, [r".*"])
    with pytest.raises(lc.LayoutError, match="A spec entry must be"):
        lc.P(1)
    with pytest.raises(lc.LayoutError, match="sizes must be integers >= 1"):
        lc.Mesh({"tp": 0})
    with pytest.raises(lc.LayoutError, match="identifier"):
        lc.Mesh({"t p": 2})


# --- TOML layout files -------------------------------------------------------------------------


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "layout.toml"
    path.write_text(text)
    return path


GOOD_TOML = """
axes = ["dp", "tp"]
[mesh]
dp = 1
tp = 1
[[rules]]
match = '\\.w$'
spec = "P('tp', None)"
[[rules]]
match = '.*'
spec = "P()"
"""


def test_toml_layout_good_file_parses(tmp_path):
    layout = lc.Layout.from_file(write_toml(tmp_path, GOOD_TOML))
    assert layout == lc.Layout(MESH1, [(r"\.w$", lc.P("tp", None)), (r".*", lc.P())])
    other = lc.Layout.from_file(write_toml(tmp_path, GOOD_TOML), lc.Mesh({"tp": 1, "dp": 1}))
    assert other.mesh == lc.Mesh({"tp": 1, "dp": 1})


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("[[rules]\nmatch = 1", ["layout.toml", "not valid TOML"]),
        ("[[rules]]\nmatch = '.*'\n", ["layout.toml", "no [mesh] table", "pass mesh="]),
        ("[mesh]\ntp = 1\n", ["layout.toml", "non-empty [[rules]]"]),
        ("rules = []\n[mesh]\ntp = 1\n", ["layout.toml", "non-empty [[rules]]"]),
        ("[mesh]\ntp = 0\n[[rules]]\nmatch = '.*'\n", ["layout.toml", "'tp'", "integers >= 1"]),
        ("mesh = 3\n[[rules]]\nmatch = '.*'\n", ["layout.toml", "[mesh]"]),
        (
            "axes = ['dp', 'tp']\n[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\n",
            ["layout.toml", "['dp', 'tp']", "size 1 is fine"],
        ),
        ("axes = 'tp'\n[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\n", ["layout.toml", "axes"]),
        ("[mesh]\ntp = 1\n[[rules]]\nspec = 'P()'\n", ["layout.toml", "rule #0", "'match' and 'spec'"]),
        ("[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nsepc = 'P()'\n", ["layout.toml", "rule #0", "'match' and 'spec'"]),
        ("[mesh]\ntp = 1\n[[rules]]\nmatch = '(x'\n", ["layout.toml", "rule #0", "'(x'", "not a valid regex"]),
        ("[mesh]\ntp = 1\n[[rules]]\nmatch = 5\n", ["layout.toml", "rule #0", "must be a string"]),
        (
            "[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = \"Q('tp')\"\n",
            ["layout.toml", "rule #0", "\"P('tp', None)\""],
        ),
        ("[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = \"P('tp'\"\n", ["layout.toml", "rule #0", "must look like"]),
        (
            "[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = 'P(tp)'\n",
            ["layout.toml", "rule #0", "'P(tp)'", "not valid"],
        ),
        ("[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = 'P(1)'\n", ["layout.toml", "rule #0", "'P(1)'", "not valid"]),
        (
            "[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = \"P(__import__('os'))\"\n",
            ["layout.toml", "rule #0", "not valid"],
        ),
        ("[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = ['tp']\n", ["layout.toml", "rule #0", "must look like"]),
        (
            "[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = \"P('dp')\"\n",
            ["layout.toml", "'.*'", "'dp'", "use one of ['tp']"],
        ),
        ("rules = ['.*']\n[mesh]\ntp = 1\n", ["layout.toml", "rule #0", "'match' and 'spec'"]),
        # ``**{...}`` is no literal keyword: taking it silently dropped it (groups, dim).
        (
            "[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = \"Padded(P(None, 'tp'), 10, **{'dim': 1})\"\n",
            ["layout.toml", "rule #0", "must look like"],
        ),
        (
            "[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\nspec = \"Padded(P('tp'), 10, value='zero')\"\n",
            ["layout.toml", "rule #0", "must be a number", "'zero'"],
        ),
        (
            "[mesh]\npp = 2\n[[rules]]\nmatch = '.*'\n[[names]]\nrenumber = '^l\\\\.(\\\\d+)'\naxis = 'pp'\nstarts = 5\n",
            ["layout.toml", "starts must be a list", "5"],
        ),
        (
            "[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\n[[names]]\nrename = '^a'\n",
            ["layout.toml", "names #0", "lacks 'to'"],
        ),
        (
            "[mesh]\npp = 2\n[[rules]]\nmatch = '.*'\n[[names]]\nrenumber = '^l\\\\.(\\\\d+)'\nper = 2\n",
            ["layout.toml", "names #0", "lacks 'axis'"],
        ),
    ],
)
def test_toml_layout_file_errors(tmp_path, text, fragments):
    with pytest.raises(lc.LayoutError) as info:
        lc.Layout.from_file(write_toml(tmp_path, text))
    assert_mentions(info.value, *fragments)


def test_toml_layout_file_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        lc.Layout.from_file(tmp_path / "nope.toml", MESH1)


def test_toml_layout_file_not_utf8_or_given_no_mesh(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("# caf\u00e9\n[mesh]\ntp = 1\n[[rules]]\nmatch = '.*'\n".encode("latin-1"))
    with pytest.raises(lc.LayoutError, match=r"latin1\.toml.*not valid TOML"):
        lc.Layout.from_file(latin1)
    with pytest.raises(lc.LayoutError, match="mesh= must be a Mesh"):
        lc.Layout.from_toml_dict({"axes": ["tp"], "rules": [{"match": ".*"}]}, {"tp": 1})


def test_renumbering_that_captures_no_number_or_too_many_starts_is_refused(tmp_path):
    layout = lc.Layout(lc.Mesh({"pp": 1}), [(".*", lc.P())], names=[lc.Renumber(r"^(layers)\.", "pp", per=2)])
    with pytest.raises(lc.LayoutError, match="captures 'layers', not a number"):
        lc.save(tmp_path / "ck", {"layers.0.w": np.ones(2)}, layout)
    with pytest.raises(lc.LayoutError, match="gives 4 starts but axis 'pp' has 2 coordinates"):
        lc.Layout(lc.Mesh({"pp": 2}), [(".*", lc.P())], names=[lc.Renumber(r"^l\.(\d+)", "pp", starts=[0, 2, 5, 9])])


def test_a_padding_value_the_dtype_cannot_hold_is_refused(tmp_path):
    lc.save(tmp_path / "ck", {"e": np.arange(6, dtype=np.int32).reshape(3, 2)})
    layout = lc.Layout(lc.Mesh({}), [(r"^e$", lc.Padded(lc.P(), 3, value=1.5))])
    with pytest.raises(lc.TemplateMismatchError, match=r"padding value 1\.5 .* is not a int32 value"):
        lc.load(tmp_path / "ck", layout, like={"e": np.zeros((4, 2), np.int32)})


# --- names, leaves, dtypes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "fragments"),
    [
        ({"model": {"..": W}}, ["'model...'", "empty part"]),
        ({"a..b": W}, ["'a..b'", "empty part"]),
        ({".a": W}, ["'.a'", "empty part"]),
        ({"a.": W}, ["'a.'", "empty part"]),
        ({"": W}, ["''", "empty part"]),
        ({"a/b": W}, ["'a/b'", "slash"]),
        ({"m": {"/etc": W}}, ["'m./etc'", "slash"]),
        ({"a\\b": W}, ["backslash"]),
        ({"a\nb": W}, ["control character"]),
        ({"__zarr": W}, ["'__zarr'", "reserved"]),
        ({"m": {"__init__": 3}}, ["'m.__init__'", "reserved"]),
        ({"a": W, "a.b": B}, ["'a'", "'a.b'", "also the parent"]),
        ({"m": {"w": W, "w.x": {"y": B}}}, ["'m.w'", "'m.w.x.y'", "also the parent"]),
        ({"a.b": W, "a": {"b": B}}, ["'a.b'", "share the global name"]),
        ({"m": {1.5: W}}, ["1.5", "str or an int"]),
        ({"m": {True: W}}, ["True", "str or an int"]),
    ],
)
def test_unsafe_names(root, state, fragments):
    refuse_save(root, state, layout1(), lc.InvalidNameError, *fragments, "rename")


@pytest.mark.parametrize(
    ("leaf", "type_name"),
    [({1, 2}, "set"), (object(), "object"), (b"raw", "bytes"), (1j, "complex"), (frozenset(), "frozenset")],
)
def test_unsupported_leaf_types(root, leaf, type_name):
    state = {"model": {"w": W, "extra": leaf}}
    refuse_save(root, state, layout1(), TypeError, "'model.extra'", type_name, "never pickle", "Convert it")


def test_state_must_be_a_container(root):
    refuse_save(root, W, layout1(), TypeError, "dict, list or tuple", "Tensor")


@pytest.mark.parametrize(
    ("leaf", "dtype"),
    [
        (torch.zeros(3, dtype=torch.complex64), "complex64"),
        (np.zeros(3, dtype=np.complex128), "complex128"),
        (np.complex64(1j), "complex64"),
        (np.array(["a", "b"]), "<U1"),
        (np.array([object()]), "object"),
    ],
)
def test_unsupported_dtypes(root, leaf, dtype):
    state = {"model": {"w": W, "z": leaf}}
    refuse_save(root, state, layout1(), TypeError, "'model.z'", dtype, "supported dtypes", "float32", "cast it")


# --- existing checkpoints ----------------------------------------------------------------------


def test_existing_checkpoint_needs_overwrite(root):
    before = snapshot(root)
    new_state = {"model": {"w": W + 1}}
    with pytest.raises(lc.CheckpointExistsError) as info:
        lc.save(root / "good", new_state, layout1())
    assert isinstance(info.value, FileExistsError)
    assert_mentions(info.value, "good", "committed checkpoint already exists", "overwrite=True")
    assert snapshot(root) == before
    assert_good(root / "good")

    (root / "stuff").mkdir()
    (root / "stuff" / "notes.txt").write_text("mine")
    before = snapshot(root)
    with pytest.raises(lc.CheckpointExistsError) as info:
        lc.save(root / "stuff", new_state, layout1())
    assert_mentions(info.value, "stuff", "not a committed layoutckpt checkpoint", "remove it")
    assert snapshot(root) == before
    # overwrite=True replaces checkpoints only: a folder that is not one is never deleted.
    with pytest.raises(lc.CheckpointExistsError) as info:
        lc.save(root / "stuff", new_state, layout1(), overwrite=True)
    assert_mentions(info.value, "stuff", "only replaces checkpoints")
    assert snapshot(root) == before


def test_overwrite_replaces_and_old_data_is_gone(root):
    old_files = {k for k in snapshot(root / "good") if k.startswith("model/b")}
    assert old_files
    lc.save(root / "good", {"model": {"w": W + 1}}, layout1(), overwrite=True)
    out = lc.load(root / "good")
    assert set(out) == {"model"} and set(out["model"]) == {"w"}
    assert torch.equal(out["model"]["w"], W + 1)
    assert lc.open(root / "good").keys() == ["model.w"]
    assert not (root / "good" / "model" / "b").exists()
    assert sorted(p.name for p in root.iterdir()) == ["good"]  # no temporary or set-aside directory left


def test_overwrite_through_a_symbolic_link_leaves_its_target_and_no_link_aside(tmp_path):
    """A checkpoint path that is a link to a checkpoint is replaced by the new one; the link is
    removed, its target left whole, and nothing set aside remains."""
    lc.save(tmp_path / "target", {"w": W}, layout1())
    (tmp_path / "link").symlink_to(tmp_path / "target")
    lc.save(tmp_path / "link", {"w": W + 1}, layout1(), overwrite=True)
    assert not (tmp_path / "link").is_symlink() and torch.equal(lc.load(tmp_path / "link")["w"], W + 1)
    assert torch.equal(lc.load(tmp_path / "target")["w"], W)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


# --- load: templates and layouts ---------------------------------------------------------------


def refuse_load(root: Path, exc: type[BaseException], *fragments: str, **kwargs) -> None:
    before = snapshot(root)
    with pytest.raises(exc) as info:
        lc.load(root / "good", **kwargs)
    assert_mentions(info.value, *fragments)
    assert snapshot(root) == before
    assert_good(root / "good")


def test_like_template_shape_differs(root):
    like = {"model": {"w": torch.empty(4, 5), "b": torch.empty(5, dtype=torch.bfloat16)}, "step": 0, "name": ""}
    refuse_load(root, lc.TemplateMismatchError, "'model.w'", "(4, 5)", "(4, 6)", "fix the template", like=like)


def test_like_template_dtype_differs(root):
    like = {"model": {"w": torch.empty(4, 6, dtype=torch.float16), "b": torch.empty(5, dtype=torch.bfloat16)}}
    refuse_load(
        root, lc.TemplateMismatchError, "'model.w'", "float16", "float32", "template of the stored dtype", like=like
    )
    like["model"]["w"] = np.empty((4, 6), dtype=np.float64)
    refuse_load(root, lc.TemplateMismatchError, "'model.w'", "float64", "float32", like=like)
    like["model"]["w"] = torch.empty(4, 6, dtype=torch.complex64)
    refuse_load(root, lc.TemplateMismatchError, "'model.w'", "complex64", "float32", like=like)


def test_like_template_names_differ(root):
    like = {"model": {"w": torch.empty(4, 6), "b": torch.empty(5, dtype=torch.bfloat16), "c": torch.empty(1)}}
    refuse_load(root, lc.TemplateMismatchError, "'model.c'", "does not hold", "remove them", like=like)
    like = {"model": {"w": torch.empty(4, 6)}}
    refuse_load(root, lc.TemplateMismatchError, "'model.b'", "template lacks", "strict=False", like=like)
    like = {"model": {"w": 0.0, "b": torch.empty(5, dtype=torch.bfloat16)}}
    refuse_load(root, lc.TemplateMismatchError, "'model.w'", "float", "stores an array", like=like)


def test_load_layout_errors(root):
    spec_long = lc.Layout(MESH1, [(r"\.b$", lc.P("tp", None)), (r".*", lc.P())])
    refuse_load(root, lc.LayoutError, "'model.b'", "(5,)", "shorten", layout=spec_long)
    no_match = lc.Layout(MESH1, [(r"\.w$", lc.P())])
    refuse_load(root, lc.LayoutError, "'model.b'", "no layout rule matches", "catch-all", layout=no_match)


# --- missing and corrupt checkpoints -----------------------------------------------------------


def test_missing_checkpoint(tmp_path):
    leftover = tmp_path / ".ck.tmp-0123456789ab"
    (leftover / "model" / "w").mkdir(parents=True)
    (leftover / "model" / "w" / "zarr.json").write_text("{}")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    before = snapshot(tmp_path)
    for path, hint in (
        (tmp_path / "nope", ""),
        (leftover, "never finished"),
        (a_file, ""),
        (tmp_path / "nope" / "x", ""),
    ):
        for call in (lc.load, lc.open):
            with pytest.raises(lc.CheckpointNotFoundError) as info:
                call(path)
            assert isinstance(info.value, FileNotFoundError)
            assert_mentions(info.value, str(path), "no committed layoutckpt checkpoint", hint)
            assert info.value.filename == str(path)
    assert snapshot(tmp_path) == before


def _edit_root(path: Path, edit) -> None:
    doc = json.loads((path / "zarr.json").read_bytes())
    edit(doc)
    (path / "zarr.json").write_text(json.dumps(doc))


def _attrs(doc) -> dict:
    return doc["attributes"]["layoutckpt"]


CORRUPTIONS = {
    "truncated": (
        lambda p: (p / "zarr.json").write_bytes((p / "zarr.json").read_bytes()[:40]),
        ["not valid JSON", "corrupt"],
    ),
    "binary": (lambda p: (p / "zarr.json").write_bytes(b"\xff\xfe\x00garbage"), ["not valid JSON", "corrupt"]),
    "empty": (lambda p: (p / "zarr.json").write_bytes(b""), ["not valid JSON"]),
    "a list": (lambda p: (p / "zarr.json").write_text("[1, 2]"), ["not a Zarr v3 group document"]),
    "an array node": (lambda p: _edit_root(p, lambda d: d.update(node_type="array")), ["not a Zarr v3 group"]),
    "zarr v2": (lambda p: _edit_root(p, lambda d: d.update(zarr_format=2)), ["not a Zarr v3 group"]),
    "no attrs": (lambda p: _edit_root(p, lambda d: d.pop("attributes")), ["without 'layoutckpt' metadata"]),
    "other attrs": (lambda p: _edit_root(p, lambda d: d.update(attributes={"x": 1})), ["without 'layoutckpt'"]),
    "attrs not a dict": (
        lambda p: _edit_root(p, lambda d: d["attributes"].update(layoutckpt=[1])),
        ["must be an object"],
    ),
    "version 0": (lambda p: _edit_root(p, lambda d: _attrs(d).update(format_version=0)), ["format version 0"]),
    "version x": (lambda p: _edit_root(p, lambda d: _attrs(d).update(format_version="x")), ["format version 'x'"]),
    "version 1.0": (lambda p: _edit_root(p, lambda d: _attrs(d).update(format_version=1.0)), ["format version 1.0"]),
    "version true": (lambda p: _edit_root(p, lambda d: _attrs(d).update(format_version=True)), ["format version True"]),
    "no version": (lambda p: _edit_root(p, lambda d: _attrs(d).pop("format_version")), ["format version None"]),
    "no arrays": (lambda p: _edit_root(p, lambda d: _attrs(d).pop("arrays")), ["'arrays'"]),
    "no tree": (lambda p: _edit_root(p, lambda d: _attrs(d).pop("tree")), ["'tree'"]),
    "no mesh": (lambda p: _edit_root(p, lambda d: _attrs(d).pop("mesh")), ["'mesh'"]),
    "no rules": (lambda p: _edit_root(p, lambda d: _attrs(d).pop("rules")), ["'rules'"]),
    "arrays a list": (lambda p: _edit_root(p, lambda d: _attrs(d).update(arrays=[])), ["malformed"]),
    "array no shape": (
        lambda p: _edit_root(p, lambda d: _attrs(d)["arrays"]["model.w"].pop("shape")),
        ["'model.w'", "'shape'"],
    ),
    "array bad shape": (
        lambda p: _edit_root(p, lambda d: _attrs(d)["arrays"]["model.w"].update(shape=[4, "6"])),
        ["'model.w'", "shape", "integers"],
    ),
    "array rank differs": (
        lambda p: _edit_root(p, lambda d: _attrs(d)["arrays"]["model.w"].update(shape=[24])),
        ["'model.w'", "differ in rank"],
    ),
    "array bad dtype": (
        lambda p: _edit_root(p, lambda d: _attrs(d)["arrays"]["model.w"].update(dtype="float128")),
        ["'model.w'", "'float128'"],
    ),
    "array bad kind": (
        lambda p: _edit_root(p, lambda d: _attrs(d)["arrays"]["model.w"].update(kind="pickle")),
        ["'model.w'", "'pickle'"],
    ),
    "bad step": (lambda p: _edit_root(p, lambda d: _attrs(d).update(step="7")), ["step"]),
    "bad mesh": (lambda p: _edit_root(p, lambda d: _attrs(d).update(mesh={"tp": 2})), ["mesh"]),
    "malformed mesh entry": (lambda p: _edit_root(p, lambda d: _attrs(d).update(mesh=[["tp", 2], "x"])), ["mesh"]),
    "writers not an object": (lambda p: _edit_root(p, lambda d: _attrs(d).update(writers=[0, 1])), ["writers"]),
    "writers name a missing array": (
        lambda p: _edit_root(p, lambda d: _attrs(d).update(writers={"nope": [0, 1]})),
        ["writers", "'nope'", "[start, step]"],
    ),
    "writer rule malformed": (
        lambda p: _edit_root(p, lambda d: _attrs(d).update(writers={"model.w": [0, "1"]})),
        ["writers", "'model.w'", "[start, step]"],
    ),
    "tree names a missing array": (
        lambda p: _edit_root(p, lambda d: _attrs(d)["arrays"].pop("model.w")),
        ["tree and the arrays table disagree", "'model.w'", "corrupt"],
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_metadata(tmp_path, corruption):
    edit, fragments = CORRUPTIONS[corruption]
    path = tmp_path / "ck"
    save_good(path)
    edit(path)
    before = snapshot(tmp_path)
    for call in (lc.load, lc.open):
        with pytest.raises(lc.FormatError) as info:
            call(path)
        assert type(info.value) is lc.FormatError
        assert isinstance(info.value, ValueError)
        assert_mentions(info.value, str(path), *fragments)
    assert snapshot(tmp_path) == before


def test_newer_format_version(tmp_path):
    path = tmp_path / "ck"
    save_good(path)
    _edit_root(path, lambda d: _attrs(d).update(format_version=99, library_version="9.0"))
    before = snapshot(tmp_path)
    for call in (lc.load, lc.open):
        with pytest.raises(lc.NewerFormatError) as info:
            call(path)
        assert isinstance(info.value, lc.FormatError)
        assert_mentions(
            info.value, str(path), "format version 99", "9.0", f"up to {lc.FORMAT_VERSION}", "upgrade layoutckpt"
        )
    assert snapshot(tmp_path) == before


def test_save_over_a_corrupt_checkpoint_needs_overwrite(tmp_path):
    path = tmp_path / "ck"
    save_good(path)
    (path / "zarr.json").write_text("{")
    before = snapshot(tmp_path)
    with pytest.raises(lc.CheckpointExistsError, match="overwrite=True"):
        lc.save(path, good_state(), lc.Layout.replicated())
    assert snapshot(tmp_path) == before
    lc.save(path, good_state(), lc.Layout.replicated(), overwrite=True)
    assert_good(path)


# --- several ranks: every rank raises, nothing is written ---------------------------------------

MESH4 = {"dp": 2, "tp": 2}


def _shard_state(rank: int, mesh: lc.Mesh) -> dict:
    tp = mesh.coords(rank)["tp"]
    return {"m": {"w": torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3).chunk(2)[tp].clone(), "b": B.clone()}}


def _layout4(mesh: lc.Mesh) -> lc.Layout:
    return lc.Layout(mesh, [(r"\.w$", lc.P("tp", None)), (r".*", lc.P())])


def _save_with_mesh(rank, group, path, axes):
    mesh = lc.Mesh(axes)
    lc.save(path, _shard_state(rank % 2, lc.Mesh({"tp": 2})), _layout4(mesh), group=group, overwrite=True)


def _save_bad(rank, group, path, case):
    mesh = lc.Mesh(MESH4)
    state = _shard_state(rank, mesh)
    w = state["m"]["w"]
    if case == "unsplit dim differs" and rank == 1:
        state["m"]["w"] = torch.zeros(w.shape[0], 4)
    elif case == "split dim wrong" and rank == 3:
        state["m"]["w"] = torch.zeros(w.shape[0] + 2, 3)
    elif case == "uneven sum" and rank == 3:
        state["m"]["w"] = torch.zeros(w.shape[0] + 1, 3)
    elif case == "extra name" and rank == 2:
        state["m"]["extra"] = torch.zeros(2)
    elif case == "missing name" and rank == 1:
        del state["m"]["b"]
    elif case == "dtype differs" and rank == 1:
        state["m"]["w"] = w.double()
    elif case == "ndim differs" and rank == 1:
        state["m"]["b"] = state["m"]["b"][None]
    elif case == "unsupported leaf" and rank == 1:
        state["m"]["opt"] = {1, 2}
    elif case == "complex" and rank == 2:
        state["m"]["w"] = w.to(torch.complex64)
    elif case == "unsafe name" and rank == 3:
        state["m"]["a/b"] = torch.zeros(1)
    elif case == "no rule" and rank == 0:
        layout = lc.Layout(mesh, [(r"\.w$", lc.P("tp", None)), (r"\.b$", lc.P())])
        state["m"]["c"] = torch.zeros(1)
        return lc.save(path, state, layout, group=group, overwrite=True)
    elif case == "json value differs":
        state["step"] = rank
    elif case == "mesh order differs" and rank == 1:
        mesh = lc.Mesh({"tp": 2, "dp": 2})
    elif case == "mesh size differs on one rank" and rank == 2:
        mesh = lc.Mesh({"dp": 2, "tp": 3})
    lc.save(path, state, _layout4(mesh), group=group, overwrite=True)


def _load_all(rank, group, path):
    out = lc.load(path, lc.Layout(lc.Mesh({"r": 2}), [(r".*", lc.P())]), group=group)
    return out["m"]["w"].tolist(), out["m"]["b"].view(torch.int16).tolist()


@pytest.fixture
def root4(ranks, tmp_path: Path) -> Path:
    """A committed checkpoint saved by four ranks at ``tmp_path / 'good'``."""
    ranks.run(_save_bad, 4, str(tmp_path / "good"), "none")
    return tmp_path


def assert_good4(ranks, root: Path) -> None:
    full = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    for w, b in ranks.run(_load_all, 2, str(root / "good")):
        assert w == full.tolist()
        assert b == B.view(torch.int16).tolist()


@pytest.mark.parametrize(
    ("nranks", "axes"),
    [(2, MESH4), (4, {"tp": 2}), (3, {"tp": 2}), (4, {"dp": 2, "tp": 3})],
)
def test_mesh_size_differs_from_world_size(ranks, root4, nranks, axes):
    before = snapshot(root4)
    for target in ("good", "new"):
        errors = ranks.run_expecting_errors(_save_with_mesh, nranks, str(root4 / target), axes)
        mesh = lc.Mesh(axes)
        for tb in errors:
            assert_mentions(tb, "WorldSizeError", repr(mesh), f"{mesh.size} devices", f"{nranks} ranks")
            assert_mentions(tb, f"multiply to {nranks}")
    assert snapshot(root4) == before
    assert_good4(ranks, root4)


MULTI_CASES = {
    # case: ({rank: fragments of the error it hits itself}, fragments on every rank)
    "unsplit dim differs": ({}, ["InconsistentShardsError", "'m.w'", "dimension 1", "from 3 to 4"]),
    "split dim wrong": (
        {
            0: ["rank 0 holds a shard of shape (5, 3)", "gives this rank (6, 3)"],
            2: ["rank 2 holds a shard of shape (5, 3)", "gives this rank (6, 3)"],
            3: ["rank 3 holds a shard of shape (7, 3)", "gives this rank (5, 3)", "(11, 3)", "same tensor"],
        },
        ["InconsistentShardsError", "'m.w'"],
    ),
    "uneven sum": ({}, ["InconsistentShardsError", "'m.w'", "dimension 0", "cannot hold equally"]),
    "extra name": ({}, ["InconsistentShardsError", "arrays only on rank 2: ['m.extra']", "same names"]),
    "missing name": ({}, ["InconsistentShardsError", "arrays only on rank 0: ['m.b']", "same names"]),
    "dtype differs": ({}, ["InconsistentShardsError", "'m.w'", "float32", "float64", "rank 1", "same names, dtypes"]),
    "ndim differs": ({}, ["InconsistentShardsError", "'m.b'", "rank 1"]),
    "unsupported leaf": ({1: ["TypeError", "'m.opt'", "set"]}, ["'m.opt'", "never pickle"]),
    "complex": ({2: ["TypeError: array 'm.w'", "complex64"]}, ["'m.w'", "cast it"]),
    "unsafe name": ({3: ["InvalidNameError", "'m.a/b'"]}, ["'m.a/b'", "rename"]),
    "no rule": ({0: ["LayoutError", "'m.c'"]}, ["'m.c'", "no layout rule matches"]),
    "json value differs": ({}, ["InconsistentShardsError", "JSON values", "equal on every rank"]),
    "mesh order differs": ({}, ["InconsistentShardsError", "Mesh({'tp': 2, 'dp': 2})", "Mesh({'dp': 2, 'tp': 2})"]),
    "mesh size differs on one rank": ({2: ["WorldSizeError", "6 devices", "4 ranks"]}, ["multiply to 4"]),
}


@pytest.mark.parametrize("case", list(MULTI_CASES))
def test_inconsistent_ranks(ranks, root4, case):
    own, everyone = MULTI_CASES[case]
    before = snapshot(root4)
    for target in ("good", "new"):
        errors = ranks.run_expecting_errors(_save_bad, 4, str(root4 / target), case)
        for rank, tb in enumerate(errors):
            assert_mentions(tb, *everyone)
            if rank in own:
                assert_mentions(tb, *own[rank])
            elif own:
                assert_mentions(tb, "InconsistentShardsError", "refused on other ranks", *(f"rank {r}: " for r in own))
    assert snapshot(root4) == before
    assert_good4(ranks, root4)


def test_bad_user_metadata_is_refused_before_writing(tmp_path: Path):
    before = snapshot(tmp_path)
    for bad in ({"lr": float("nan")}, {"obj": object()}, {1: "x"}):
        with pytest.raises(TypeError, match="metadata") as info:
            lc.save(tmp_path / "ck", {"w": torch.zeros(2)}, lc.Layout.replicated(), metadata=bad)
        assert "JSON" in str(info.value) or "must be a str" in str(info.value)
        assert snapshot(tmp_path) == before


def test_select_of_a_stored_name_this_load_gives_otherwise_says_so(tmp_path):
    """Under a Flat rule the buffer 'm' is one name of the load; its parameters are stored
    under theirs. select= of a stored parameter name says which names the load gives."""
    flat = lc.Layout(lc.Mesh({"dp": 1}), [(r"^m$", lc.Flat([("a", (4, 3)), ("b", (3,))], "dp")), (r".*", lc.P())])
    lc.save(tmp_path / "ck", {"m": torch.randn(15)}, flat)
    assert lc.open(tmp_path / "ck").keys() == ["m.a", "m.b"]
    with pytest.raises(KeyError, match=r"\['m\.a'\], which the checkpoint holds but this load does not give.*\['m'\]"):
        lc.load(tmp_path / "ck", flat, select=["m.a"])
    with pytest.raises(KeyError, match=r"\['x'\] that the checkpoint does not have"):
        lc.load(tmp_path / "ck", flat, select=["x"])


def test_a_numpy_padding_value_is_taken_as_its_number(tmp_path):
    # A pad id read from a NumPy table: np.int64 is no Python int, but a number all the same.
    layout = lc.Layout(lc.Mesh({}), [(r"^e$", lc.Padded(lc.P(), 3, value=np.int64(-100)))])
    lc.save(tmp_path / "ck", {"e": np.arange(6, dtype=np.int32).reshape(3, 2)}, layout)
    got = lc.load(tmp_path / "ck", layout, like={"e": np.zeros((4, 2), np.int32)})["e"]
    assert got[3].tolist() == [-100, -100] and type(layout.rules[0][1].value) is int
    with pytest.raises(lc.LayoutError, match="must be a number"):
        lc.Padded(lc.P(), 3, value=True)
