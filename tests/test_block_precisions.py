"""precision="mxfp8" / "nvfp4": the Guard trains the Linear layers that fit in the block-scaled
format by emulation (ampguard.fp8._block, ampguard.fp8._emulate), on a CPU, without torchao."""

from __future__ import annotations

import copy
import math
import warnings
from collections import OrderedDict

import pytest
import torch
from _precisions import block_scaled
from torch import nn

import ampguard as ag
from ampguard import cli, precisions
from ampguard.fp8._emulate import EmulatedLinear
from ampguard.fp8._formats import FORMATS as PLAN_FORMATS
from ampguard.fp8._operand import Operand
from ampguard.fp8._quant import CASTS

FORMATS = block_scaled()
# wide enough for every block format's matmul dimensions (fp8_blockwise: multiples of 128)
WIDTH = math.lcm(32, *(PLAN_FORMATS[f].multiple for f in FORMATS))
pytestmark = pytest.mark.filterwarnings("ignore:precision='[a-z0-9_]+' is emulated")


def _model(width: int = WIDTH, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        OrderedDict(
            a=nn.Linear(width, width), act=nn.Tanh(), b=nn.Linear(width, width), out=nn.Tanh()
        )
    )


def _data(width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, width, generator=gen)
    return x, torch.tanh(x @ torch.randn(width, width, generator=gen) / width**0.5)


def _steps(guard: ag.Guard, model: nn.Module, n: int, width: int = WIDTH) -> list[float]:
    x, y = _data(width)
    losses = []
    for _ in range(n):
        with guard.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        guard.backward(loss)
        guard.step()
        losses.append(loss.item())
    return losses


def _guard(model: nn.Module, precision: str, **kw) -> ag.Guard:
    return ag.Guard(model, torch.optim.Adam(model.parameters(), lr=1e-2), precision=precision, **kw)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_guard_trains_in_the_format(fmt):
    model = _model()
    guard = _guard(model, fmt)
    assert guard.precision == fmt and guard.fp8 is not None
    assert guard.fp8.layers == ["a", "b"] and guard.fp8.emulated
    assert all(type(model.get_submodule(n)) is EmulatedLinear for n in ("a", "b"))
    losses = _steps(guard, model, 20)
    assert losses[-1] < 0.5 * losses[0], losses
    assert guard.fp8.summary()["converted"] == ["a", "b"] and guard.fp8.findings() == []


def _cast(t: torch.Tensor, fmt: str, role: str) -> torch.Tensor:
    return CASTS[fmt](Operand(t.float()), role).q.clone()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_layers_compute_in_the_format(fmt):
    model = _model()
    plain = copy.deepcopy(model)
    guard = _guard(model, fmt)
    x = torch.randn(8, WIDTH)
    with guard.autocast(), torch.no_grad():
        y = model.a(x)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        y_bf16 = plain.a(x)
    w, b = plain.a.weight.detach(), plain.a.bias.detach()
    want = (_cast(x, fmt, "input") @ _cast(w, fmt, "weight").T + b).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=0, atol=0)  # the emulated matmul, bitwise
    assert not torch.equal(y, y_bf16)  # not bf16's matmul
    err = float((y.float() - y_bf16.float()).norm() / y_bf16.float().norm())
    assert err < (0.1 if fmt == "mxfp8" else 0.4)  # quantised, still close


def test_an_all_zero_operand_quantises_to_zeros_not_nan():
    model = _model()
    guard = _guard(model, "nvfp4")
    x = torch.zeros(4, WIDTH, requires_grad=True)
    with guard.autocast():
        y = model.a(x)
    torch.testing.assert_close(y.float(), model.a.bias.detach().expand(4, -1), atol=1e-2, rtol=0)
    y.float().sum().backward()  # a zero input: the weight gradient's operand is all zeros
    assert torch.equal(model.a.weight.grad, torch.zeros_like(model.a.weight))


@pytest.mark.parametrize("fmt", FORMATS)
def test_revert_is_exact_and_leaves_parameters_and_optimizer_state(fmt):
    model = _model()
    params = list(model.parameters())
    guard = _guard(model, fmt)
    _steps(guard, model, 2)
    opt = guard.optimizers[0]
    state = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(model.state_dict())
    guard.fp8.revert()
    assert all(type(m) is nn.Linear for m in (model.a, model.b))
    assert not hasattr(model.a, "lowp_format") and list(model.parameters()) == params
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert str(opt.state_dict()) == str(state)
    assert guard.fp8.layers == [] and guard.fp8.kept == ["a", "b"]


def test_a_model_without_an_eligible_layer_trains_in_bf16_with_a_warning():
    model = _model(width=24)  # 24 features: a multiple of neither 32 nor 16
    with pytest.warns(RuntimeWarning, match="no Linear layer is converted"):
        guard = _guard(model, "nvfp4")
    assert guard.precision == "bf16" and guard.requested_precision == "nvfp4"
    assert type(model.a) is nn.Linear
    losses = _steps(guard, model, 5, width=24)
    assert losses[-1] < losses[0]


def test_mxfp8_needs_multiples_of_32_nvfp4_of_16():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(32, 48), b=nn.Linear(48, 32)))
    assert _guard(copy.deepcopy(model), "nvfp4").fp8.layers == ["a", "b"]
    with pytest.warns(RuntimeWarning, match="no Linear layer is converted"):
        assert _guard(model, "mxfp8").fp8.layers == []


# ---------------------------------------------------------------------- with a plan
def _deep(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for name in ("a", "b", "c"):
        layers[name] = nn.Linear(WIDTH, WIDTH)
        layers[f"{name}_act"] = nn.Tanh()
    return nn.Sequential(layers)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).float().pow(2).mean()


@pytest.fixture(scope="module")
def plan():
    pytest.importorskip("torchao")  # ag.fp8_plan's fp8 verdict is torchao's recipe
    return ag.fp8_plan(_deep(), _loss, torch.randn(64, WIDTH), formats=tuple(FORMATS))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_plan_converts_the_layers_its_recipe_puts_in_low_precision(plan, fmt):
    recipe = plan.recipe()
    assert recipe["a"] == recipe["c"] == "bf16"  # the first and last Linear stay in bf16
    assert recipe["b"] in FORMATS and plan.layers["b"]["formats"][fmt]["ready"]
    model = _deep()
    guard = _guard(model, fmt, fp8_plan=plan)
    assert guard.fp8.layers == ["b"] and guard.fp8.kept == ["a", "c"]
    assert type(model.a) is nn.Linear and type(model.b) is EmulatedLinear
    assert guard.fp8.summary()["plan"] == recipe


def test_a_plan_that_did_not_measure_the_format_is_refused(plan):
    only_mx = ag.fp8_plan(_deep(), _loss, torch.randn(64, WIDTH), formats=("mxfp8",))
    model = _deep()
    with pytest.raises(ValueError, match=r"fp8_plan did not measure 'nvfp4'.*formats="):
        _guard(model, "nvfp4", fp8_plan=only_mx)
    assert type(model.b) is nn.Linear  # nothing touched
    with pytest.raises(TypeError, match="fp8_plan must be an ampguard.Fp8Plan"):
        _guard(model, "mxfp8", fp8_plan={"b": "mxfp8"})
    with pytest.raises(ValueError, match="another model"):
        _guard(_model(), "mxfp8", fp8_plan=plan)


def test_a_checkpoint_resumes_with_the_same_layers_and_the_same_losses(plan, tmp_path):
    model = _deep()
    guard = _guard(model, "mxfp8", fp8_plan=plan)
    opt = guard.optimizers[0]
    _steps(guard, model, 4)
    path = ag.save_checkpoint(tmp_path / "ck.pt", model=model, optimizer=opt, guard=guard)
    assert guard.state_dict()["fp8"] == {"format": "mxfp8", "converted": ["b"]}
    after = _steps(guard, model, 3)

    # the resumed Guard is built without the plan, so it chooses every layer; the saved state
    # wins and it trains exactly "b" in mxfp8 again, with a warning saying so
    model2 = _deep(seed=7)
    guard2 = _guard(model2, "mxfp8")
    assert guard2.fp8.layers == ["a", "b", "c"]
    with pytest.warns(RuntimeWarning, match="resuming with the saved layers"):
        ag.load_checkpoint(path, model=model2, optimizer=guard2.optimizers[0], guard=guard2)
    assert guard2.fp8.layers == ["b"] and type(model2.a) is nn.Linear
    assert _steps(guard2, model2, 3, width=WIDTH) == after

    # the same plan again: the same layers, nothing to warn about
    model3 = _deep(seed=8)
    guard3 = _guard(model3, "mxfp8", fp8_plan=plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ag.load_checkpoint(path, model=model3, optimizer=guard3.optimizers[0], guard=guard3)
    assert guard3.fp8.layers == ["b"]


def test_a_state_of_another_format_or_a_malformed_one_is_refused():
    model = _model()
    guard = _guard(model, "mxfp8")
    _steps(guard, model, 1)
    state = guard.state_dict()
    other = _guard(_model(), "nvfp4")
    with pytest.raises(ValueError, match="create the Guard with precision='mxfp8'"):
        other.load_state_dict(state)
    assert other.fp8.layers == ["a", "b"]
    for bad in ({"format": "mxfp8", "converted": "a"}, {"format": "mxfp8", "converted": ["zz"]}):
        with pytest.raises(ValueError, match="malformed Guard state: 'fp8"):
            _guard(_model(), "mxfp8").load_state_dict({**state, "fp8": bad})
    with pytest.raises(ValueError, match="saved with precision='mxfp8'"):
        _guard(_model(), "bf16").load_state_dict(state)


# ---------------------------------------------------------------------- the registry
def test_the_registry_entries():
    for name, code in (("mxfp8", 4), ("nvfp4", 5)):
        entry = precisions.REGISTRY[name]
        assert (entry.autocast_dtype, entry.loss_scale, entry.audit_code) == (
            "bfloat16",
            "none",
            code,
        )
        assert entry.needs_bf16 and not entry.watchable and entry.extra is None
        assert entry.load_hook().format == name
        assert precisions.by_audit_code(code) == name and precisions.watched_as(name) == "bf16"


def test_the_cli_lists_them_as_precision_choices(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--precision", "fp4"])
    err = capsys.readouterr().err
    assert "invalid choice: 'fp4'" in err and "'mxfp8', 'nvfp4'" in err


def test_the_demo_trains_in_nvfp4(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--precision", "nvfp4", "--steps", "3", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    assert "3 steps in nvfp4" in capsys.readouterr().out
    assert (out / "checkpoint.pt").exists()


def test_a_block_state_given_to_an_fp8_guard_names_the_precision_to_create():
    pytest.importorskip("torchao")
    model = _model()
    guard = _guard(model, "mxfp8")
    _steps(guard, model, 1)
    state = guard.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated fp8 on CPU
        fp8 = _guard(_model(), "fp8")
        with pytest.raises(ValueError, match="create the Guard with precision='mxfp8'") as info:
            fp8.load_state_dict(state)
        assert "malformed" not in str(info.value)
        saved = fp8.state_dict()
    saved["fp8"] = {"rescued": []}  # an fp8 state, as an fp8 Guard with rescues saves it
    with pytest.raises(ValueError, match="create the Guard with precision='fp8'") as info:
        _guard(_model(), "nvfp4").load_state_dict(saved)
    assert "malformed" not in str(info.value)
