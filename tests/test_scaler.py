"""The loss-scale state machine: config validation, hand-written scale sequences, torch parity.

Expected sequences are written by hand from torch.amp.GradScaler's semantics and the pseudocode in
``LossScaler``'s docstring ("o" = an overflowing step, "." = a clean step; each list holds the
scale after every step).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampguard.core.scaler import LossScaler, ScalerConfig, collect_grads

CPU = torch.device("cpu")


def run(config: ScalerConfig, pattern: str) -> tuple[list[float], list[bool]]:
    """Feed ``pattern`` to a fresh LossScaler; return the scales and collapse flags per step."""
    scaler = LossScaler(config, CPU)
    scales, collapses = [], []
    for ch in pattern:
        collapse = scaler.update(torch.tensor(1.0 if ch == "o" else 0.0))
        scales.append(scaler.scale())
        collapses.append(bool(collapse))
    return scales, collapses


# ---------------------------------------------------------------------- config validation
@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_factor": float("nan")}, "growth_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": -0.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"hysteresis": 1.5}, "hysteresis"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"min_scale": float("inf")}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"init_scale": 0.5}, "init_scale"),
        ({"init_scale": 2.0**25}, "init_scale"),
        ({"init_scale": 8.0, "min_scale": 16.0, "max_scale": 64.0}, "init_scale"),
        ({"on_collapse": "ignore"}, "on_collapse"),
        ({"on_collapse": None}, "on_collapse"),
        ({"consecutive_hysteresis": 1}, "consecutive_hysteresis"),
    ],
)
def test_bad_config_is_a_value_error_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=rf"ScalerConfig\.{argument} "):
        ScalerConfig(**kwargs)


def test_on_collapse_error_lists_the_allowed_values():
    with pytest.raises(ValueError, match=r"\('raise', 'warn', 'fallback'\)"):
        ScalerConfig(on_collapse="stop")


def test_defaults_match_torch_grad_scaler():
    cfg, torch_scaler = ScalerConfig(), torch.amp.GradScaler("cpu")
    assert cfg.init_scale == torch_scaler.get_scale()
    assert cfg.growth_factor == torch_scaler.get_growth_factor()
    assert cfg.backoff_factor == torch_scaler.get_backoff_factor()
    assert cfg.growth_interval == torch_scaler.get_growth_interval()


def test_config_to_dict_round_trips():
    cfg = ScalerConfig(
        init_scale=64.0, hysteresis=3, consecutive_hysteresis=True, on_collapse="warn"
    )
    assert ScalerConfig(**cfg.to_dict()) == cfg


# ---------------------------------------------------------------------- scale sequences
def test_growth_every_interval_of_clean_steps():
    scales, _ = run(ScalerConfig(init_scale=4.0, growth_interval=3), ".......")
    assert scales == [4, 4, 8, 8, 8, 16, 16]


def test_backoff_on_every_overflow():
    scales, _ = run(ScalerConfig(init_scale=1024.0), "oo.o")
    assert scales == [512, 256, 256, 128]


def test_overflow_resets_the_growth_tracker():
    scales, _ = run(ScalerConfig(init_scale=64.0, growth_interval=2), ".o...")
    assert scales == [64, 32, 32, 64, 64]


def test_custom_growth_and_backoff_factors():
    cfg = ScalerConfig(init_scale=64.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=1)
    scales, _ = run(cfg, "..o")
    assert scales == [256, 1024, 256]


def test_cap_stops_growth_at_max_scale():
    scales, _ = run(ScalerConfig(init_scale=4.0, growth_interval=1, max_scale=16.0), "....")
    assert scales == [8, 16, 16, 16]


def test_cap_that_is_not_a_power_of_the_growth_factor_clamps():
    scales, _ = run(ScalerConfig(init_scale=4.0, growth_interval=1, max_scale=12.0), "...o")
    assert scales == [8, 12, 12, 6]


def test_floor_stops_backoff_at_min_scale():
    scales, _ = run(ScalerConfig(init_scale=8.0, min_scale=3.0), "ooo")
    assert scales == [4, 3, 3]


def test_overflow_at_the_floor_is_a_collapse():
    _, collapses = run(ScalerConfig(init_scale=4.0, min_scale=1.0), "oooo.o")
    assert collapses == [False, False, True, True, False, True]


def test_backoff_onto_the_floor_is_not_a_collapse():
    # The scale reaches the floor by backing off; only the next overflow at the floor collapses.
    _, collapses = run(ScalerConfig(init_scale=2.0, min_scale=1.0), "o")
    assert collapses == [False]


def test_scale_below_one_is_allowed_down_to_min_scale():
    scales, collapses = run(ScalerConfig(init_scale=1.0, min_scale=0.25), "ooo")
    assert (scales, collapses) == ([0.5, 0.25, 0.25], [False, False, True])


def test_hysteresis_delays_backoff_until_the_budget_is_spent():
    cfg = ScalerConfig(init_scale=256.0, growth_interval=100, hysteresis=3)
    scales, _ = run(cfg, "ooooo")
    assert scales == [256, 256, 128, 64, 32]


def test_hysteresis_budget_not_refilled_by_clean_steps_without_growth():
    # DeepSpeed-ZeRO semantics (consecutive_hysteresis=False), init 256, window 4, hysteresis 2.
    cfg = ScalerConfig(init_scale=256.0, growth_interval=4, hysteresis=2)
    scales, _ = run(cfg, "o.o.o")
    assert scales == [256, 256, 128, 128, 64]


def test_hysteresis_budget_refilled_when_the_scale_grows():
    # Megatron semantics: interval 2, the growth at step 3 refills the budget.
    cfg = ScalerConfig(init_scale=256.0, growth_interval=2, hysteresis=2)
    scales, _ = run(cfg, "o..oo")
    assert scales == [256, 256, 512, 512, 256]


def test_consecutive_hysteresis_refills_on_every_clean_step():
    cfg = ScalerConfig(
        init_scale=256.0, growth_interval=4, hysteresis=2, consecutive_hysteresis=True
    )
    scales, _ = run(cfg, "o.o.o")
    assert scales == [256, 256, 256, 256, 256]


def test_consecutive_hysteresis_backs_off_after_h_overflows_in_a_row():
    cfg = ScalerConfig(
        init_scale=256.0, growth_interval=4, hysteresis=2, consecutive_hysteresis=True
    )
    scales, _ = run(cfg, "oo.ooo")
    assert scales == [256, 128, 128, 128, 64, 32]


def test_absorbed_overflow_still_resets_the_growth_tracker():
    # Without the reset the scale would grow at step 3 (three non-overflow-reset steps).
    cfg = ScalerConfig(init_scale=16.0, growth_interval=3, hysteresis=2)
    scales, _ = run(cfg, "..o....")
    assert scales == [16, 16, 16, 16, 16, 32, 32]


def test_hysteresis_collapse_only_when_the_budget_is_spent_at_the_floor():
    cfg = ScalerConfig(init_scale=2.0, min_scale=1.0, growth_interval=100, hysteresis=2)
    scales, collapses = run(cfg, "oooo")
    assert scales == [2, 1, 1, 1]
    assert collapses == [False, False, True, True]


def test_static_scale_never_changes():
    scales, collapses = run(
        ScalerConfig(init_scale=128.0, growth_interval=1, dynamic=False), "..oo.."
    )
    assert scales == [128.0] * 6
    assert not any(collapses)


# ---------------------------------------------------------------------- reference model
def reference(cfg: ScalerConfig, pattern: list[bool]) -> list[tuple[float, int, int, bool]]:
    """The docstring pseudocode in plain Python: (scale, growth_tracker, budget, collapse)."""
    scale, tracker, budget = cfg.init_scale, 0, cfg.hysteresis
    out = []
    for found in pattern:
        collapse = False
        if found:
            tracker = 0
            budget = max(budget - 1, 0)
            if budget == 0:
                collapse = scale <= cfg.min_scale
                scale = max(scale * cfg.backoff_factor, cfg.min_scale)
        else:
            tracker += 1
            if cfg.consecutive_hysteresis:
                budget = cfg.hysteresis
            if tracker == cfg.growth_interval:
                tracker = 0
                budget = cfg.hysteresis
                if math.isfinite(scale * cfg.growth_factor):
                    scale = min(scale * cfg.growth_factor, cfg.max_scale)
        # With hysteresis=1 the budget is not tracked (every overflow backs off regardless).
        out.append((scale, tracker, budget if cfg.hysteresis > 1 else None, collapse))
    return out


@settings(max_examples=60, deadline=None)
@given(
    pattern=st.lists(st.booleans(), min_size=1, max_size=40),
    init_log2=st.integers(0, 6),
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
    min_scale=st.sampled_from([1.0, 2.0, 3.0]),
    max_scale=st.sampled_from([64.0, 96.0, 2.0**10]),
)
def test_scaler_follows_the_docstring_pseudocode(
    pattern, init_log2, interval, hysteresis, consecutive, min_scale, max_scale
):
    cfg = ScalerConfig(
        init_scale=max(2.0**init_log2, min_scale),
        growth_interval=interval,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=min_scale,
        max_scale=max_scale,
    )
    scaler = LossScaler(cfg, CPU)
    got = []
    for found in pattern:
        collapse = bool(scaler.update(torch.tensor(float(found))))
        state = scaler.state_dict()
        budget = state["hysteresis_tracker"] if hysteresis > 1 else None
        got.append((state["scale"], state["growth_tracker"], budget, collapse))
    assert got == reference(cfg, pattern)


def test_huge_scale_growth_stops_short_of_inf():
    cfg = ScalerConfig(
        init_scale=2.0**120, growth_factor=2.0**10, growth_interval=1, max_scale=3e38
    )
    scales, _ = run(cfg, "..")
    assert all(math.isfinite(s) for s in scales)
    assert scales[-1] <= 3e38


# ---------------------------------------------------------------------- parity with torch
def test_scale_and_tracker_match_torch_amp_update_scale():
    """Hysteresis 1: the state machine is torch's kernel, step by step, on a long pattern."""
    cfg = ScalerConfig(init_scale=2.0**10, growth_interval=3, min_scale=2.0**-30)
    ours = LossScaler(cfg, CPU)
    scale = torch.full((), cfg.init_scale)
    tracker = torch.zeros((), dtype=torch.int32)
    pattern = "...o....oo......o.o.........o"
    for ch in pattern:
        found = torch.tensor(1.0 if ch == "o" else 0.0)
        ours.update(found)
        torch._amp_update_scale_(
            scale, tracker, found, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval
        )
        assert torch.equal(ours.scale_tensor, scale)
        assert ours.state_dict()["growth_tracker"] == int(tracker)


def test_inv_scale_rounds_like_torch():
    # 1/3 in fp64 rounded to fp32 is what torch's GradScaler multiplies by.
    scaler = LossScaler(ScalerConfig(init_scale=3.0), CPU)
    expected = torch.full((), 3.0, dtype=torch.float64).reciprocal().float()
    assert torch.equal(scaler.inv_scale(), expected)


def test_scale_loss_multiplies_by_the_scale():
    scaler = LossScaler(ScalerConfig(init_scale=8.0), CPU)
    assert scaler.scale_loss(torch.tensor(0.5)).item() == 4.0


# ---------------------------------------------------------------------- unscale and check
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_flags_non_finite_grads(bad):
    grads = [torch.full((3,), 4.0), torch.full((2, 2), 8.0)]
    grads[1][0, 1] = bad
    found = LossScaler(ScalerConfig(init_scale=4.0), CPU).unscale_(grads)
    assert found.item() > 0


def test_unscale_divides_finite_grads_by_the_scale():
    grads = [torch.full((3,), 4.0), torch.full((4,), 8.0, dtype=torch.float64)]
    found = LossScaler(ScalerConfig(init_scale=4.0), CPU).unscale_(grads)
    assert found.item() == 0
    assert torch.equal(grads[0], torch.ones(3))
    assert torch.equal(grads[1], torch.full((4,), 2.0, dtype=torch.float64))


def test_unscale_of_no_grads_finds_nothing():
    assert LossScaler(ScalerConfig(), CPU).unscale_([]).item() == 0


def test_check_leaves_grads_unchanged():
    grads = [torch.full((3,), 4.0)]
    found = LossScaler(ScalerConfig(init_scale=4.0), CPU).check_(grads)
    assert found.item() == 0
    assert torch.equal(grads[0], torch.full((3,), 4.0))


def test_collect_grads_skips_params_without_grad():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    b.grad = torch.full((3,), 2.0)
    assert [g.shape for g in collect_grads([a, b])] == [torch.Size([3])]


def test_fp16_sparse_grads_are_coalesced_before_the_check():
    # 64000 + 64000 at a duplicate index overflows fp16 only once summed (torch's own test case).
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.sparse_coo_tensor(
        [[1, 1, 3]],
        torch.tensor([64000.0, 64000.0, 1.0], dtype=torch.float16),
        (4,),
        check_invariants=True,
    )
    found = LossScaler(ScalerConfig(init_scale=1.0), CPU).check_(collect_grads([p]))
    assert found.item() > 0


# ---------------------------------------------------------------------- state
def test_state_dict_round_trips_trackers():
    cfg = ScalerConfig(init_scale=64.0, growth_interval=5, hysteresis=3)
    a = LossScaler(cfg, CPU)
    for ch in "..o":
        a.update(torch.tensor(1.0 if ch == "o" else 0.0))
    b = LossScaler(cfg, CPU)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert a.state_dict()["hysteresis_tracker"] == 2


def test_state_dict_loads_with_weights_only(tmp_path):
    scaler = LossScaler(ScalerConfig(hysteresis=2), CPU)
    torch.save(scaler.state_dict(), tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == scaler.state_dict()


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"scale": "x", "growth_tracker": 0},
        {"scale": float("nan"), "growth_tracker": 0},
        {"scale": 0.0, "growth_tracker": 0},
    ],
)
def test_bad_state_is_a_value_error(state):
    with pytest.raises(ValueError, match="invalid scaler state"):
        LossScaler(ScalerConfig(), CPU).load_state_dict(state)
