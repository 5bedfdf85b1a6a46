"""Mesh, P and Layout: small immutable values that hash, compare and print as code."""

from __future__ import annotations

import pytest

import layoutckpt as lc
from layoutckpt.layout._layout import parse_spec


def test_mesh_coords_are_row_major_and_invert():
    mesh = lc.Mesh({"dp": 2, "tp": 4})
    assert mesh.size == 8
    assert [tuple(mesh.coords(r).values()) for r in range(8)] == [(d, t) for d in range(2) for t in range(4)]
    assert all(mesh.rank_of(mesh.coords(r)) == r for r in range(8))
    with pytest.raises(lc.LayoutError, match="outside"):
        mesh.coords(8)


@pytest.mark.parametrize(
    "value",
    [lc.Mesh({"dp": 2, "tp": 4}), lc.Mesh({}), lc.P("tp", None), lc.P(("dp", "tp"), None), lc.P()],
)
def test_repr_round_trips_and_hashes(value):
    rebuilt = eval(repr(value), {"Mesh": lc.Mesh, "P": lc.P})
    assert rebuilt == value
    assert hash(rebuilt) == hash(value)


def test_layout_repr_round_trips():
    layout = lc.Layout(lc.Mesh({"tp": 2}), [(r"\.w$", lc.P("tp")), (r".*", lc.P())])
    rebuilt = eval(repr(layout), {"Layout": lc.Layout, "Mesh": lc.Mesh, "P": lc.P})
    assert rebuilt == layout
    assert hash(rebuilt) == hash(layout)
    assert lc.Layout.from_json(layout.to_json()) == layout


def test_values_are_immutable():
    spec = lc.P("tp")
    with pytest.raises(AttributeError):
        spec.x = 1  # type: ignore[attr-defined]
    mesh = lc.Mesh({"tp": 2})
    with pytest.raises(AttributeError):
        mesh.axes = ()  # type: ignore[misc]


def test_spec_normalizes_single_axis_tuples():
    assert lc.P(("tp",)) == lc.P("tp")
    assert lc.P(()) == lc.P(None)
    assert lc.P(("dp", "tp")).axes == ("dp", "tp")


def test_first_matching_rule_wins():
    layout = lc.Layout(
        lc.Mesh({"tp": 2}),
        [(r"q_proj\.weight$", lc.P("tp", None)), (r"proj\.weight$", lc.P(None, "tp")), (r".*", lc.P())],
    )
    assert layout.spec_for("layers.0.q_proj.weight") == lc.P("tp", None)
    assert layout.spec_for("layers.0.o_proj.weight") == lc.P(None, "tp")
    assert layout.spec_for("norm.weight") == lc.P()


def test_parse_spec_is_literal_only():
    assert parse_spec("P('tp', None)") == lc.P("tp", None)
    assert parse_spec("P(('dp', 'tp'))") == lc.P(("dp", "tp"))
    for bad in ["__import__('os')", "P(open('x'))", "Q('tp')", "P(tp)", "P('tp',"]:
        with pytest.raises(lc.LayoutError, match="spec"):
            parse_spec(bad)


def test_layout_from_file_with_its_own_mesh(tmp_path):
    path = tmp_path / "l.toml"
    path.write_text("[mesh]\ntp = 2\n\n[[rules]]\nmatch = 'w$'\nspec = \"P('tp')\"\n\n[[rules]]\nmatch = '.*'\n")
    layout = lc.Layout.from_file(path)
    assert layout.mesh == lc.Mesh({"tp": 2})
    assert layout.spec_for("a.w") == lc.P("tp")
    assert layout.spec_for("a.b") == lc.P()
    assert lc.Layout.from_file(path, lc.Mesh({"tp": 4})).mesh.size == 4


def test_rule_with_an_unknown_key_names_it():
    doc = {"mesh": {"tp": 2}, "rules": [{"match": "w$", "spec": "P('tp')"}, {"match": ".*", "sepc": "P()"}]}
    with pytest.raises(lc.LayoutError) as info:
        lc.Layout.from_toml_dict(doc, source="l.toml")
    message = str(info.value)
    for fragment in ("l.toml", "rule #1", "'sepc'", "'match' and 'spec'", "'note'", "did you mean 'spec'"):
        assert fragment in message, f"{fragment!r} not in {message!r}"
    # The optional note is allowed; a rule without match is refused by name.
    assert lc.Layout.from_toml_dict({"mesh": {"tp": 1}, "rules": [{"match": ".*", "note": "all"}]})
    with pytest.raises(lc.LayoutError, match=r"rule #0 lacks 'match'"):
        lc.Layout.from_toml_dict({"mesh": {"tp": 1}, "rules": [{"spec": "P()"}]})


@pytest.mark.parametrize(
    ("entries", "axis"),
    [(("tp", "tp"), "tp"), ((("dp", "tp"), "tp"), "tp"), ((("dp", "dp"),), "dp"), ((None, "dp", ("tp", "dp")), "dp")],
)
def test_an_axis_named_twice_is_refused_when_the_spec_is_built(entries, axis):
    # Whatever the mesh: no mesh axis can split two dimensions, or one dimension twice.
    with pytest.raises(lc.LayoutError, match=rf"uses axis '{axis}' twice"):
        lc.P(*entries)
    # A layout file names the rule.
    spec = repr(entries)[1:-1].rstrip(",")
    doc = {"mesh": {"dp": 2, "tp": 2}, "rules": [{"match": ".*", "spec": f"P({spec})"}]}
    with pytest.raises(lc.LayoutError, match=rf"l\.toml: rule #0: .* uses axis '{axis}' twice"):
        lc.Layout.from_toml_dict(doc, source="l.toml")


def test_a_flat_axis_named_twice_is_refused_by_the_layout():
    flat = lc.Flat([("a", (4,))], ("dp", "dp"))
    with pytest.raises(lc.LayoutError, match=r"Layout rule 'buf': .* uses axis 'dp' twice"):
        lc.Layout(lc.Mesh({"dp": 2}), [("buf", flat)])


@pytest.mark.parametrize("stages", [{"stages": "pp"}, {"names": [lc.Renumber(r"^layers\.(\d+)\.", "pp", per=2)]}])
def test_a_spec_over_a_stage_axis_is_refused_by_the_layout(stages):
    """Along a stage axis the ranks hold different arrays: none is split over it."""
    with pytest.raises(lc.LayoutError, match=r"Layout rule '\.\*': spec P\('pp'\) splits arrays over 'pp'"):
        lc.Layout(lc.Mesh({"pp": 2, "tp": 2}), [(r".*", lc.P("pp"))], **stages)
