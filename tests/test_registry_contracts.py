"""Contract tests over ampguard's registries, parameterised from the registries themselves.

As optax's ``contrib/_common_test.py`` runs every optimizer through the same tests, these run
every entry of a registry through one contract, so a new entry is tested without a new test:

- every precision of :data:`ampguard.precisions.REGISTRY` trains a step, saves a checkpoint,
  resumes from it bitwise, and refuses a resume that does not fit (another model; another
  precision is refused or warned about, never taken silently);
- every scaler adapter of :data:`ampguard.integrations._seam.ADAPTERS` passes the same attach
  tests (what ``ag.watch`` asks of a scaler);
- every format of :data:`ampguard.fp8._formats.FORMATS` measures a layer in ``ag.fp8_plan``.

Small models (32 wide, a multiple of every format's block), two steps, CPU.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard import precisions
from ampguard.fp8._formats import FORMATS
from ampguard.integrations import _seam

# 32 wide, or wider where a format needs it: every format's matmul dimensions fit
WIDTH = math.lcm(32, *(f.multiple for f in FORMATS.values()))


def _model(seed: int = 0, extra_layer: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)]
    if extra_layer:
        layers.append(nn.Linear(WIDTH, WIDTH))
    return nn.Sequential(*layers)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen)


def _request(name: str, model: nn.Module) -> Any:
    """What ``precision=`` takes for entry ``name``: its name, or for an entry chosen by its value
    (``by_name=False``: a per-layer recipe) such a value, every Linear in one block format."""
    if precisions.REGISTRY[name].by_name:
        return name
    fmt = precisions.single_format()[0]
    return {n: fmt for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _trained(name: str, seed: int = 0, **model_kw: Any) -> tuple[nn.Module, Any, ag.Guard]:
    """A model, AdamW and a Guard in precision ``name`` (skipped where its extra is missing)."""
    model = _model(seed, **model_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the block formats say they are emulated
        try:
            guard = ag.Guard(model, opt, precision=_request(name, model))
        except ImportError as exc:  # an entry whose hook needs an extra that is not installed
            entry = precisions.REGISTRY[name]
            if entry.extra is None:
                raise
            pytest.skip(f"precision {name!r} needs ampguard[{entry.extra}]: {exc}")
    return model, opt, guard


def _step(model: nn.Module, guard: ag.Guard, i: int) -> float:
    x, y = _batch(i)
    with guard.autocast():
        loss = F.mse_loss(model(x).float(), y)
    guard.backward(loss)
    guard.step()
    return float(loss.detach())


def _state(model: nn.Module, opt: Any) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for s in opt.state_dict()["state"].values():
        tensors += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    same = (x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return len(a) == len(b) and all(same)


# ---------------------------------------------------------------------- every precision
@pytest.mark.parametrize("name", precisions.names())
def test_every_precision_trains_a_step(name):
    model, _, guard = _trained(name)
    before = [p.detach().clone() for p in model.parameters()]
    loss = _step(model, guard, 0)
    assert math.isfinite(loss)
    assert guard.precision == name and guard.steps == 1
    assert guard.uses_scaler == precisions.REGISTRY[name].needs_scaler
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def _saved(name: str, path: Any) -> tuple[nn.Module, Any, ag.Guard]:
    """A run in precision ``name`` after one step, checkpointed to ``path``."""
    model, opt, guard = _trained(name)
    _step(model, guard, 0)
    ag.save_checkpoint(path, model=model, optimizer=opt, guard=guard)
    return model, opt, guard


@pytest.mark.parametrize("name", precisions.names())
def test_every_precision_saves_and_resumes_bitwise(name, tmp_path):
    path = tmp_path / "c.pt"
    model, opt, guard = _saved(name, path)
    _step(model, guard, 1)

    live, live_opt, live_guard = _trained(name, seed=5)
    ag.load_checkpoint(path, model=live, optimizer=live_opt, guard=live_guard)
    assert live_guard.steps == 1 and live_guard.precision == name
    _step(live, live_guard, 1)
    assert live_guard.steps == guard.steps == 2
    assert live_guard.scale == guard.scale
    assert _bitwise(_state(live, live_opt), _state(model, opt))


@pytest.mark.parametrize("name", precisions.names())
def test_every_precision_refuses_a_resume_that_does_not_fit(name, tmp_path):
    path = tmp_path / "c.pt"
    _saved(name, path)

    # another model: refused, and nothing changed
    live, live_opt, live_guard = _trained(name, seed=5, extra_layer=True)
    before, steps = _state(live, live_opt), live_guard.steps
    with pytest.raises(ag.CheckpointError, match="does not fit") as info:
        ag.load_checkpoint(path, model=live, optimizer=live_opt, guard=live_guard)
    assert str(path) in str(info.value)
    assert _bitwise(_state(live, live_opt), before) and live_guard.steps == steps

    # another precision: refused, or taken with a warning that names both; never silently
    other = next(n for n, p in precisions.REGISTRY.items() if n != name and p.hook is None)
    live, live_opt, live_guard = _trained(other, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ag.load_checkpoint(path, model=live, optimizer=live_opt, guard=live_guard)
        except ag.CheckpointError as exc:
            assert repr(name) in str(exc) and repr(other) in str(exc)
            return
    said = " ".join(str(w.message) for w in caught)
    assert f"saved in {name}" in said and f"precision={other!r}" in said
    assert live_guard.precision == other


# ---------------------------------------------------------------------- every scaler adapter
def _torch_scaler() -> Any:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10)


def _deepspeed_scaler() -> Any:
    scalers = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    return scalers.DynamicLossScaler(2.0**10, 1000, 1.0, 2, False)


# An enabled scaler of each adapter's package, keyed as ADAPTERS is: the one line a new adapter
# adds here (the test below fails on an adapter without one).
SPECIMENS: dict[str, Callable[[], Any]] = {
    "torch": _torch_scaler,
    "deepspeed": _deepspeed_scaler,
}


def test_every_adapter_has_a_specimen():
    assert set(SPECIMENS) == set(_seam.ADAPTERS)


class _Listener:
    def on_scaler_loss(self, loss: torch.Tensor) -> None: ...

    def on_scaler_grads(self, scaled: bool) -> None: ...

    def on_scaler_update(self, outcome: _seam.StepOutcome) -> None: ...


@pytest.mark.parametrize("package", sorted(_seam.ADAPTERS))
def test_every_adapter_attaches_through_the_seam(package):
    scaler = SPECIMENS[package]()
    seen = _seam.adapt(scaler)
    assert isinstance(seen, _seam.WatchableScaler), package
    assert isinstance(seen.name, str) and seen.name
    assert seen.scaled is True and seen.watched is False
    scale = seen.scale()
    value = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
    assert value == 2.0**10
    view = _seam.ScaleView(seen, torch.device("cpu"))
    assert float(view.scale_tensor) == value and float(view.inv_scale()) == 1 / value
    described = seen.describe()
    assert described["init_scale"] == value
    assert (seen.guard_tensors() is not None) == seen.correctable
    seen.attach(_Listener(), set())
    try:
        assert seen.watched
    finally:
        seen.detach()
    assert not seen.watched


# ---------------------------------------------------------------------- every plan format
def _plan_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]).float(), batch[1])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_measures_a_layer(fmt):
    pytest.importorskip("torchao")  # the block formats' reference quantisers
    model = _model()
    plan = ag.fp8_plan(model, _plan_loss, _batch(0), formats=(fmt,))
    assert list(plan.layers) == ["0", "2"]
    for layer in plan.layers.values():
        figures = layer["formats"][fmt]
        assert figures["eligible"] is True  # WIDTH is a multiple of every format's multiple
        assert math.isfinite(figures["sqnr_db"]) and figures["sqnr_db"] > 0
        for role in ("input", "weight", "grad"):
            assert 0.0 <= figures[f"{role}_flushed"] <= 1.0
            assert 0.0 <= figures[f"{role}_saturated"] <= 1.0
        assert isinstance(figures["ready"], bool) and figures["reason"]
    assert set(plan.recipe()) == {"0", "2"}
