"""Flattening pytrees to global names and rebuilding them from the stored JSON structure."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import layoutckpt as lc
from layoutckpt.layout._tree import decode_value, flatten, leaf_nodes, name_to_path, unflatten


def _rebuild(structure, leaves, keep=None):
    return unflatten(structure, lambda name, node: leaves[name] if "array" in node else decode_value(node), keep)


def test_names_join_keys_with_dots_and_map_to_paths():
    t = torch.zeros(1)
    structure, leaves = flatten({"model": {"layers.0.w": t, "b": [t, {"c": t}]}, 3: t})
    assert list(leaves) == ["model.layers.0.w", "model.b.0", "model.b.1.c", "3"]
    assert name_to_path("model.layers.0.w") == "model/layers/0/w"
    assert [n for n, _ in leaf_nodes(structure)] == list(leaves)


def test_structure_is_json_and_rebuilds_types_and_keys():
    t = torch.arange(3)
    state = {"a": [t, (1, "x", None)], 7: {"f": 1.5, "inf": -math.inf, "nan": math.nan, "flag": True}, "empty": {}}
    structure, leaves = flatten(state)
    structure = json.loads(json.dumps(structure, allow_nan=False))
    out = _rebuild(structure, leaves)
    assert out["a"][0] is t and out["a"][1] == (1, "x", None)
    assert isinstance(out["a"][1], tuple)
    assert 7 in out and out[7]["f"] == 1.5 and out[7]["inf"] == -math.inf and math.isnan(out[7]["nan"])
    assert out[7]["flag"] is True and out["empty"] == {}


def test_keep_prunes_dicts_and_holds_list_positions():
    t = np.zeros(2)
    structure, leaves = flatten({"a": [t, t, t], "b": {"c": t}, "d": 1})
    out = _rebuild(structure, leaves, keep={"a.1"})
    assert list(out) == ["a"]
    assert out["a"][0] is None and out["a"][1] is t and out["a"][2] is None


@pytest.mark.parametrize("key", ["..", "", "a/b", "a\\b", "__x", "a\x00"])
def test_unsafe_names_are_refused(key):
    with pytest.raises(lc.InvalidNameError, match="rename"):
        flatten({key: torch.zeros(1)})


def test_colliding_names_are_refused():
    with pytest.raises(lc.InvalidNameError, match="share the global name"):
        flatten({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}})
    with pytest.raises(lc.InvalidNameError, match="also the parent"):
        flatten({"a": torch.zeros(1), "a.b": torch.zeros(1)})


def test_non_json_leaves_are_refused_not_pickled():
    with pytest.raises(TypeError, match="never pickle"):
        flatten({"x": {1, 2}})
    with pytest.raises(TypeError, match="must be a dict"):
        flatten(torch.zeros(1))
