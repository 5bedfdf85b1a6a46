"""Model and optimizer state in one call, through ``torch.distributed.checkpoint.state_dict``.

``get_state_dict`` already does the hard parts the same way for every parallelism: it keys the
optimizer's state by fully-qualified parameter names (not by the optimizer's integer ids, which
change when the model is wrapped differently), hands FSDP2 and tensor-parallel parameters over
as DTensors, and creates the optimizer's state when a fresh optimizer has none yet, which gives a
freshly parallelized model a complete template to load into. What is left here is to store that
tree and to give it back.
"""

from __future__ import annotations

import os
from typing import Any

from ._load import load
from .layout._layout import Layout


def _optimizers(optimizer: Any) -> tuple[Any, ...]:
    if optimizer is None:
        return ()
    return tuple(optimizer) if isinstance(optimizer, list | tuple) else (optimizer,)


def get_state(model: Any, optimizer: Any = None, *, options: Any = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of a (possibly FSDP2 / tensor-parallel) model and optimizer.

    Keys are fully-qualified parameter names; sharded parameters and optimizer moments are
    DTensors, so ``lc.save(path, state)`` needs no layout. ``optimizer`` may be one optimizer,
    a list of them, or None (model only). ``options`` is a ``StateDictOptions``.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    optims = _optimizers(optimizer)
    if not optims:
        return {"model": get_model_state_dict(model, options=options)}
    model_state, optim_state = get_state_dict(model, optims, options=options)
    return {"model": model_state, "optim": optim_state}


def set_state(model: Any, optimizer: Any, state: dict[str, Any], *, options: Any = None) -> None:
    """Put ``state`` (as ``get_state`` gives it, e.g. loaded) into the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    optims = _optimizers(optimizer)
    if not optims:
        set_model_state_dict(model, state["model"], options=options)
        return
    if "optim" not in state:
        raise KeyError("the state holds no 'optim' entry; pass optimizer=None to restore the model only")
    set_state_dict(model, optims, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def load_state(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    layout: Layout | None = None,
    *,
    strict: bool = True,
    group: Any = None,
    options: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint saved from ``get_state`` into ``model`` (and ``optimizer``), resharded.

    The template is the model's own state: its DTensors say where every shard goes, whatever
    parallelism saved the checkpoint. Returns the loaded state. With ``optimizer=None`` only
    the model is restored (the checkpoint may hold optimizer state too).
    """
    template = get_state(model, optimizer, options=options)
    select = None if _optimizers(optimizer) or not strict else _model_only
    state = load(path, layout, like=template, strict=strict, select=select, group=group)
    set_state(model, optimizer, state, options=options)
    return state


def _model_only(name: str) -> bool:
    return name.startswith("model.")
