"""The argument checks at the top of ``save`` and ``load``: mistakes a caller makes by habit.

``torch.save(obj, f)``, safetensors' ``save_file(tensors, filename)`` and DCP's
``dcp.save(state_dict, checkpoint_id=...)`` take the state first; ``lc.save(path, state,
layout)`` takes the path first, as ``open`` and ``load`` do. A state where the path goes would
otherwise reach the storage code and fail there with a message about kvstore specs, so the swap
is caught here, by type alone, before anything is read or written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def _is_path(x: Any) -> bool:
    """A local path, a URL, or a TensorStore kvstore spec (a mapping with a ``driver``)."""
    return isinstance(x, str | os.PathLike) or (isinstance(x, Mapping) and "driver" in x)


def _what(x: Any) -> str:
    """How a wrong argument reads in a message: its type, with the module it comes from."""
    if isinstance(x, Mapping):
        return f"a {type(x).__name__} without a 'driver' member (so not a kvstore spec)"
    kind = type(x)
    module = kind.__module__
    return f"a {kind.__name__}" if module == "builtins" else f"a {module.split('.')[0]} {kind.__name__}"


def _is_module_or_optimizer(x: Any) -> bool:
    """An ``nn.Module`` or optimizer, known without importing torch: it has ``state_dict()``."""
    return callable(getattr(x, "state_dict", None)) and not isinstance(x, Mapping)


def check_save_arguments(verb: str, path: Any, state: Any, layout: Any, layout_type: type) -> None:
    """Raise ``TypeError`` naming the mistake when ``save``'s arguments are swapped or of the wrong kind."""
    order = f"lc.{verb}(path, state, layout)"
    if not _is_path(path):
        swapped = f" and {_what(state)} as state: swap them" if _is_path(state) else ""
        raise TypeError(
            f"{order} takes the path first (torch.save and safetensors' save_file take it second); "
            f"got {_what(path)} as path{swapped}"
        )
    if _is_module_or_optimizer(state):
        raise TypeError(
            f"{order} takes a state (a dict of tensors), got {_what(state)}; pass lc.get_state(model, optimizer) "
            "or model.state_dict()"
        )
    if layout is not None and not isinstance(layout, layout_type):
        raise TypeError(f"{order} takes an lc.Layout (or None) as layout, got {_what(layout)}")


def check_load_arguments(verb: str, path: Any, layout: Any, layout_type: type) -> None:
    """Raise ``TypeError`` naming the mistake when ``load``'s arguments are swapped or of the wrong kind."""
    order = f"lc.{verb}(path, layout, like=template)"
    if not _is_path(path):
        swapped = f" and {_what(layout)} as layout: swap them" if _is_path(layout) else ""
        raise TypeError(f"{order} takes the path first; got {_what(path)} as path{swapped}")
    if layout is None or isinstance(layout, layout_type):
        return
    if isinstance(layout, Mapping) or _is_module_or_optimizer(layout):
        raise TypeError(
            f"{order} takes an lc.Layout as its second argument, got {_what(layout)}; pass a template as like="
        )
    raise TypeError(f"{order} takes an lc.Layout (or None) as layout, got {_what(layout)}")


def check_model_arguments(verb: str, model: Any, optimizer: Any, path: Any = None) -> None:
    """Raise ``TypeError`` naming the mistake when ``get_state``'s or ``load_state``'s model and
    optimizer are not a module and optimizers (or ``path`` is no path: arguments swapped)."""
    import torch

    order = f"lc.{verb}(path, model, optimizer)" if verb == "load_state" else f"lc.{verb}(model, optimizer)"
    if verb == "load_state" and not _is_path(path):
        swapped = ": pass the path first" if _is_path(model) or _is_path(optimizer) else ""
        raise TypeError(f"{order} takes the checkpoint's path first; got {_what(path)} as path{swapped}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{order} takes a torch.nn.Module as model, got {_what(model)}")
    optims = optimizer if isinstance(optimizer, list | tuple) else [] if optimizer is None else [optimizer]
    wrong = next((o for o in optims if not isinstance(o, torch.optim.Optimizer)), None)
    if wrong is not None:
        raise TypeError(f"{order} takes a torch optimizer, a list of them or None as optimizer, got {_what(wrong)}")
