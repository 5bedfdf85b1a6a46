"""``lc.load_state`` in one plain process: checkpoints of ``get_state`` and plain
``model.state_dict()`` ones both restore the model; what is missing is said (a warning for an
absent optimizer state, a typed error under ``strict``) before anything changes; and the result
is a short summary, not the state.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import layoutckpt as lc


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 16)
        self.register_buffer("scale", torch.tensor(1.0))


class Wrapped(nn.Module):
    """A model with a submodule called ``model``, as Hugging Face's ``LlamaForCausalLM`` has:
    its plain state dict names ``model.embed.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()
        self.lm_head = nn.Linear(8, 3)


def trained(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    with torch.no_grad():
        for b in model.buffers():
            b.add_(3)
    return model, opt


def fresh(kind: type[nn.Module] = Net) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(2)
    model = kind()
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def moments(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [s["exp_avg"] for s in opt.state_dict()["state"].values()]


def test_a_plain_state_dict_restores_the_model_and_says_the_optimizer_is_not(tmp_path):
    model, _ = trained(Net())
    lc.save(tmp_path / "plain", model.state_dict(), step=7)
    target, opt = fresh()
    with pytest.warns(UserWarning, match="holds no optimizer state .*plain state_dict.*pass optimizer=None"):
        done = lc.load_state(tmp_path / "plain", target, opt)
    assert same(target, model)
    assert done.path == str(tmp_path / "plain") and done.step == 7 and done.restored == ("model",)
    assert done.missing and all(n.startswith("optim.state.") or n.startswith("optim.param") for n in done.missing)
    assert done.unexpected == ()
    assert opt.state_dict()["state"] == {}  # the fresh optimizer's own state: none yet
    text = repr(done)
    assert len(text) < 300 and text.startswith("LoadStateResult(path=") and "more)" in text
    # Without an optimizer: no warning, nothing missing.
    target, _ = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        done = lc.load_state(tmp_path / "plain", target)
    assert same(target, model) and done.missing == () and done.restored == ("model",)


def test_a_checkpoint_of_get_state_restores_model_and_optimizer(tmp_path):
    model, opt = trained(Net())
    lc.save(tmp_path / "full", {**lc.get_state(model, opt), "loader": {"position": 3}}, step=2)
    target, target_opt = fresh()
    done = lc.load_state(tmp_path / "full", target, target_opt)
    assert done.restored == ("model", "optimizer") and done.missing == () and done.unexpected == ()
    assert same(target, model)
    assert all(torch.equal(a, b) for a, b in zip(moments(target_opt), moments(opt), strict=True))
    assert repr(done) == (
        f"LoadStateResult(path={str(tmp_path / 'full')!r}, step=2, restored=('model', 'optimizer'), "
        "missing=(), unexpected=())"
    )


def test_a_model_with_a_submodule_named_model_is_read_as_plain(tmp_path):
    model, _ = trained(Wrapped())
    lc.save(tmp_path / "hf", model.state_dict())
    target, _ = fresh(Wrapped)
    assert lc.load_state(tmp_path / "hf", target).restored == ("model",)
    assert same(target, model)


def test_missing_entries_raise_under_strict_before_anything_changes(tmp_path):
    model, _ = trained(Net())
    partial = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
    lc.save(tmp_path / "part", {**partial, "extra": torch.zeros(2)})
    target, _ = fresh()
    untouched = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(lc.TemplateMismatchError, match=r"lacks 2 of the model's 6 entries, e.g. \['head.weight'"):
        lc.load_state(tmp_path / "part", target)
    assert all(torch.equal(untouched[k], v) for k, v in target.state_dict().items())

    done = lc.load_state(tmp_path / "part", target, strict=False)
    assert done.missing == ("model.head.weight", "model.head.bias") and done.unexpected == ("extra",)
    got, want = target.state_dict(), model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in partial)
    assert torch.equal(got["head.weight"], untouched["head.weight"])


def test_a_checkpoint_of_another_model_is_named_as_such(tmp_path):
    lc.save(tmp_path / "other", {"w": torch.zeros(3)})
    target, opt = fresh()
    with pytest.raises(lc.TemplateMismatchError, match="holds none of the model's 6 parameters and buffers"):
        lc.load_state(tmp_path / "other", target, opt)


def test_part_of_an_optimizer_state_is_refused_under_strict(tmp_path):
    model, opt = trained(Net())
    state = lc.get_state(model, opt)
    del state["optim"]["state"]["head.bias"]["exp_avg"]  # a parameter's whole state missing means "not stepped"
    lc.save(tmp_path / "cut", state)
    target, target_opt = fresh()
    with pytest.raises(lc.TemplateMismatchError, match="part of the optimizer's state only"):
        lc.load_state(tmp_path / "cut", target, target_opt)
    with pytest.warns(UserWarning, match="part of the optimizer's state only"):
        done = lc.load_state(tmp_path / "cut", target, target_opt, strict=False)
    assert done.restored == ("model",) and "optim.state.head.bias.exp_avg" in done.missing
    assert same(target, model)


class WithUnused(Net):
    """A model with a module no loss reaches, as an expert no token is routed to."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(8, 8)


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    tokens = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(seed))
    loss = model.head(model.norm(model.embed(tokens))).logsumexp(-1).mean() * model.scale
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_parameters_the_optimizer_never_stepped_resume_without_state(tmp_path):
    """AdamW holds no state for ``unused``: the checkpoint holds none, and a fresh optimizer
    restores the rest under strict, with the losses of the run that went on."""
    torch.manual_seed(0)
    model = WithUnused()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for seed in range(3):
        _step(model, opt, seed)
    lc.save(tmp_path / "ck", lc.get_state(model, opt))
    went_on = [_step(model, opt, seed) for seed in (3, 4)]

    torch.manual_seed(9)
    target = WithUnused()
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.05)
    done = lc.load_state(tmp_path / "ck", target, target_opt)
    assert done.restored == ("model", "optimizer") and done.missing == ()
    assert [_step(target, target_opt, seed) for seed in (3, 4)] == went_on


def test_get_state_leaves_an_optimizer_that_has_not_stepped_as_it_was(tmp_path):
    """``get_state_dict`` makes a fresh optimizer's state (a template to load into) with a step
    at lr 0, which AdamW counts: a save before the first step must not change the run."""
    runs = []
    for save_first in (False, True):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        if save_first:
            state = lc.get_state(model, opt)
            assert state["optim"]["state"] and opt.state_dict()["state"] == {}
            lc.save(tmp_path / "at0", state)
        runs.append([_step(model, opt, seed) for seed in range(3)])
    assert runs[0] == runs[1]


def _grouped(model: nn.Module, reverse: bool) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "lr": 0.05, "weight_decay": 0.1},
        {"params": others, "lr": 0.02, "betas": (0.8, 0.9)},
    ]
    return torch.optim.AdamW(groups[::-1] if reverse else groups)


def test_param_groups_listed_in_another_order_restore_by_parameter(tmp_path):
    """Groups of different sizes, listed the other way round by the resumed run: each group's
    hyper-parameters follow its parameters, as ``set_state_dict`` matches them by name."""
    torch.manual_seed(0)
    model = Net()
    opt = _grouped(model, reverse=False)
    for seed in range(2):
        _step(model, opt, seed)
    lc.save(tmp_path / "ck", lc.get_state(model, opt))
    went_on = [_step(model, opt, seed) for seed in (2, 3)]
    target, _ = fresh()
    target_opt = _grouped(target, reverse=True)
    assert lc.load_state(tmp_path / "ck", target, target_opt).restored == ("model", "optimizer")
    assert [_step(target, target_opt, seed) for seed in (2, 3)] == went_on


def test_an_optimizer_whose_parameters_hold_gradients_is_restored(tmp_path):
    """A backward before restoring (a warm-up, a compile step): torch makes no template state
    for an optimizer whose parameters hold gradients; the moments must still be restored, and
    the gradients left as they were."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    lc.save(tmp_path / "ck", lc.get_state(model, opt))
    fresh = nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh(torch.randn(8, 4)).pow(2).mean().backward()
    grad = fresh.weight.grad
    lc.load_state(tmp_path / "ck", fresh, fresh_opt)
    assert fresh.weight.grad is grad
    want, got = opt.state[model.weight], fresh_opt.state[fresh.weight]
    assert all(torch.equal(want[k], got[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def test_state_of_a_param_group_the_optimizer_lacks_is_named_as_the_optimizers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model[0].parameters())
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 1e-3})
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    lc.save(tmp_path / "ck", lc.get_state(model, opt))
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(lc.TemplateMismatchError, match=r"param groups the optimizer lacks.*add_param_group") as err:
        lc.load_state(tmp_path / "ck", fresh, torch.optim.AdamW(fresh[0].parameters()))
    assert "the model lacks" not in str(err.value)
