"""The stagnation rescue's vectorised write-back on real training runs: bitwise the documented
per-parameter arithmetic (the fp32 step on copies, then ``kahan_write`` / ``stochastic_round`` of
each parameter in order with one generator), for bf16 and fp16, Kahan, stochastic rounding and
a mix; a parameter the rescue does not cover is never touched; the Kahan split and the
stochastic rounding are exactly the documented ones (bit patterns and every noise value
enumerated); the rescue's own work per step does not grow with the number of parameters."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampguard.core.rescue import SEED, Rescue
from ampguard.core.rounding import (
    draw_noise,
    kahan_buffer,
    kahan_read,
    kahan_split_,
    kahan_write,
    round_with_noise_,
)


def model_of(
    dtype: torch.dtype, depth: int = 3, seed: int = 0, frozen: bool = False
) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(4.0)  # updates of 1e-4 below half an ulp
    if frozen:  # no gradient: the optimizer skips it, and so must the rescue
        model[2].requires_grad_(False)
    return model.to(dtype)


def batches(steps: int):
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(16, 4, generator=gen)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        yield x, torch.tanh(x) @ target


OPTS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, eps=1e-4),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, weight_decay=0.01),
}


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return F.mse_loss(model(x.to(dtype)).float(), y)


def rescued_run(dtype, opt_name, methods: dict[int, str], steps: int, frozen: bool = False):
    """The Rescue's hooks on a plain loop."""
    model = model_of(dtype, frozen=frozen)
    opt = OPTS[opt_name](model.parameters())
    rescue = Rescue([opt], list(model.parameters()))
    for method in ("kahan", "stochastic"):
        rescue.cover([i for i, m in methods.items() if m == method], method)
    for x, y in batches(steps):
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    comps = {i: c.clone() for i, c in rescue.comp.items()}
    return model, opt, comps


def reference_run(dtype, opt_name, methods: dict[int, str], steps: int, frozen: bool = False):
    """The documented arithmetic one parameter at a time: the covered parameters step as fp32
    twins (value = what the weight and its Kahan buffer hold; gradient and states in fp32), then
    each is written back: Kahan ones by ``kahan_write``, the stochastic ones' values rounded with
    one draw of noise sliced in the parameters' order; the others step in their own dtype; a
    parameter without a gradient is left alone."""
    model = model_of(dtype, frozen=frozen)
    params = list(model.parameters())
    covered = [i for i in range(len(params)) if i in methods]
    twins = [nn.Parameter(params[i].detach().float()) for i in covered]
    plain = [params[i] for i in range(len(params)) if i not in methods]
    topt = OPTS[opt_name](twins)
    popt = OPTS[opt_name](plain) if plain else None
    comp = {i: kahan_buffer(params[i]) for i in covered if methods[i] == "kahan"}
    low: list[dict] = [{} for _ in covered]  # the covered parameters' states, in their dtype
    gen = torch.Generator().manual_seed(SEED)
    for x, y in batches(steps):
        loss_of(model, x, y).backward()
        with torch.no_grad():
            for t, i, saved in zip(twins, covered, low, strict=True):
                p = params[i]
                if p.grad is None:
                    t.grad = None
                    continue
                t.data = kahan_read(p, comp[i]) if i in comp else p.detach().float()
                t.grad = p.grad.float()
                for k, v in saved.items():
                    topt.state[t][k] = v.float()
            topt.step()
            order = [j for j in range(len(covered)) if params[covered[j]].grad is not None]
            pieces, targets = [], []
            for j in order:
                t, i = twins[j], covered[j]
                if methods[i] == "kahan":
                    kahan_write(t.data, params[i].data, comp[i])
                else:  # one draw of 16-bit noise for the stochastic ones, in their order
                    pieces.append(t.data.flatten().clone())
                    targets.append(params[i].data)
            if pieces:
                noise = draw_noise(sum(x.numel() for x in pieces), gen, torch.device("cpu"))
                offset = 0
                for x, target in zip(pieces, targets, strict=True):
                    n = x.numel()
                    round_with_noise_(x, dtype, noise[offset : offset + n])
                    target.copy_(x.view_as(target))
                    offset += n
            for j in order:
                t, i, saved = twins[j], covered[j], low[j]
                for k, v in topt.state[t].items():
                    if v.dim() > 0:
                        saved[k] = v.to(params[i].dtype)
            if popt is not None:
                popt.step()
        model.zero_grad(set_to_none=True)
    states = {i: saved for i, saved in zip(covered, low, strict=True)}
    return model, popt, comp, states


@pytest.mark.parametrize(
    ("dtype", "opt_name", "pattern"),
    [
        (torch.bfloat16, "adamw", "kahan"),
        (torch.bfloat16, "sgd", "stochastic"),
        (torch.bfloat16, "adamw", "mixed"),
        (torch.bfloat16, "adamw", "frozen"),
        (torch.float16, "adamw", "kahan"),
        (torch.float16, "sgd", "mixed"),
    ],
)
def test_the_vectorised_write_back_is_bitwise_the_per_parameter_arithmetic(
    dtype, opt_name, pattern
):
    n = len(list(model_of(dtype).parameters()))  # 8: four Linear layers
    if pattern == "mixed":  # what "auto" makes: Kahan, stochastic and uncovered layers
        methods = {0: "kahan", 1: "kahan", 2: "stochastic", 3: "stochastic", 6: "kahan"}
    else:  # "frozen": Kahan everywhere, one layer without gradients
        methods = dict.fromkeys(range(n), "kahan" if pattern == "frozen" else pattern)
    frozen = pattern == "frozen"
    steps = 10
    model, opt, comps = rescued_run(dtype, opt_name, methods, steps, frozen)
    ref, _, ref_comp, ref_states = reference_run(dtype, opt_name, methods, steps, frozen)
    for i, (a, b) in enumerate(zip(model.parameters(), ref.parameters(), strict=True)):
        assert a.dtype == dtype and torch.equal(a, b), f"parameter {i}"
    assert comps.keys() == ref_comp.keys()
    for i, c in comps.items():
        assert torch.equal(c, ref_comp[i]), f"Kahan buffer {i}"
    params = list(model.parameters())
    for i, saved in ref_states.items():
        state = opt.state[params[i]]
        for k, v in saved.items():
            assert state[k].dtype == dtype and torch.equal(state[k], v), f"state {k} of {i}"


# ---------------------------------------------------------------- the rounding, exactly
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_over_every_noise_value_is_exactly_the_documented_probability(dtype):
    # bf16 everywhere and fp16 in its normal range: the share of the 2**16 noise values that
    # round up is exactly the distance from the value below, in units of the spacing; fp16
    # subnormals (below 2**-14, spacing 2**-24): that distance truncated to 16 bits
    values = [1.0 + 1e-3, -0.3337, 3.1e-3, -7.77e-5, 1e-5, 123.456, 2.0**-14 + 2.0**-30]
    values += [3e-6, -1e-6, 2.0**-14 - 2.0**-26, 1e-9, 3e-38, 1e-40]  # fp16 subnormal range
    noise = torch.arange(1 << 16, dtype=torch.int32)
    tiny = 2.0**-14 if dtype == torch.float16 else 0.0
    for v in values:
        x = torch.tensor(v, dtype=torch.float32)
        out = round_with_noise_(x.repeat(1 << 16), dtype, noise.clone())
        assert torch.equal(out.to(dtype).float(), out)  # every result is a value of dtype
        mag = abs(float(x))
        down = torch.tensor(mag).to(dtype)
        if float(down) > mag:  # nearest went up: the one below
            down = torch.nextafter(down, torch.tensor(0.0, dtype=dtype))
        up = torch.nextafter(down, torch.tensor(float("inf"), dtype=dtype))
        lo, hi = float(down), float(up)
        assert set(out.abs().unique().tolist()) <= {lo, hi}
        ups = int((out.abs() == hi).sum()) if mag != lo else 0
        share = (mag - lo) / (hi - lo) * (1 << 16)  # float64: exact for these
        if mag >= tiny:
            assert ups == share, (v, ups, share)
        else:
            assert ups == int(share), (v, ups, share)  # truncated to 16 bits
        assert bool((torch.sign(out) == torch.sign(x)).all() or mag < 2.0**-24)


# ---------------------------------------------------------------- cost
class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def one_step_ops(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    x, y = next(batches(1))
    loss_of(model, x, y).backward()
    with OpCounter() as counter:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return counter.ops


def test_a_parameter_the_rescue_does_not_cover_is_never_touched():
    model = model_of(torch.bfloat16)
    opt = OPTS["adamw"](model.parameters())
    bare = model_of(torch.bfloat16)
    bare_opt = OPTS["adamw"](bare.parameters())
    rescue = Rescue([opt], list(model.parameters()))  # attached, nothing covered yet
    for _ in range(2):
        assert one_step_ops(model, opt) == one_step_ops(bare, bare_opt)  # zero extra work
    rescue.cover([0, 1], "kahan")  # the first layer only
    last = model[6].weight
    data, state = last.data_ptr(), dict(opt.state[last])
    x, y = next(batches(1))
    loss_of(model, x, y).backward()
    grad = last.grad
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append((last.dtype, last.grad is grad)))
    opt.step()
    assert seen == [(torch.bfloat16, True)]  # during the step: its own tensors
    assert last.data_ptr() == data and last.grad is grad
    assert all(opt.state[last][k] is v for k, v in state.items())  # the same state tensors
    assert model[0].weight.dtype == torch.bfloat16 and 0 in rescue.comp


def test_one_random_draw_per_group_whatever_the_number_of_parameters():
    for depth in (1, 5):
        for method, draws_wanted in (("kahan", 0), ("stochastic", 1)):
            model = model_of(torch.bfloat16, depth=depth)
            opt = OPTS["adamw"](model.parameters())
            rescue = Rescue([opt], list(model.parameters()))
            rescue.cover(list(range(len(rescue.params))), method)
            one_step_ops(model, opt)  # the first step creates the states
            ops = one_step_ops(model, opt)
            draws = [op for op in ops if "rand" in op]
            assert len(draws) == draws_wanted, (depth, method, draws)
            # one rounding pass per group: Kahan's split, or the stochastic truncation
            assert ops.count("bitwise_and_") == 1


# ---------------------------------------------------------------- the Kahan split, exactly
def random_patterns(n: int = 200_000) -> torch.Tensor:
    """fp32 values of every kind: ``n`` random bit patterns (both signs, subnormals, huge,
    infinities and NaN) and the edge patterns (ties, the largest finite, zeros)."""
    gen = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int64, generator=gen)
    edges = [0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0, 0x80000000]
    edges += [0x477FE000, 0x477FF000, 0x38800000, 0x00000001, 0x7F800000, 0x7FC00000]
    edges_t = torch.tensor(edges, dtype=torch.int64)
    edges_t = torch.where(edges_t >= 2**31, edges_t - 2**32, edges_t)
    return torch.cat([bits, edges_t]).to(torch.int32).view(torch.float32)


def kahan_round_trip(dtype: torch.dtype):
    """``random_patterns()`` through ``kahan_write`` into ``dtype`` and back: the values, the
    stored weights, what ``kahan_read`` gives back and the finite mask."""
    value = random_patterns()
    stored = torch.empty(value.shape, dtype=dtype)
    comp = kahan_buffer(stored)
    kahan_write(value, stored, comp)
    return value, stored, kahan_read(stored, comp), value.isfinite()


def test_the_bf16_kahan_pair_is_the_fp32_value_bitwise_and_the_weight_its_nearest():
    value, stored, back, finite = kahan_round_trip(torch.bfloat16)
    assert torch.equal(back.view(torch.int32)[finite], value.view(torch.int32)[finite])
    assert torch.equal(back.isnan(), value.isnan()) and torch.equal(back.isinf(), value.isinf())
    nearest = value.to(torch.bfloat16).float()  # round to nearest even
    both = finite & nearest.isfinite() & stored.isfinite()
    assert ((stored.float() - value).abs() <= (nearest - value).abs())[both].all()
    assert torch.equal(stored.signbit()[finite], value.signbit()[finite])  # no sign flips
    assert torch.equal(value, random_patterns()) or bool(value.isnan().any())  # left as it was


def test_the_fp16_kahan_pair_is_exact_in_range_and_the_weight_its_nearest():
    value, stored, back, finite = kahan_round_trip(torch.float16)
    assert torch.equal(stored[finite], value[finite].to(torch.float16))  # nearest even
    exact = finite & (value.abs() >= 2.0**-16) & (value.abs() <= 65504)
    assert int(exact.sum()) > 1000
    assert torch.equal(back.view(torch.int32)[exact], value.view(torch.int32)[exact])
    small = finite & (value.abs() < 2.0**-16)  # the buffer clamped: at worst what fp16 loses
    assert ((back - value).abs() <= (stored.float() - value).abs())[small].all()
    over = finite & (value.abs() > 65520)  # overflowed: inf, as without a buffer
    assert back[over].isinf().all() and stored[over].isinf().all()


def test_kahan_split_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="float32"):
        kahan_split_(
            torch.zeros(3, dtype=torch.float64), torch.bfloat16, torch.zeros(3, dtype=torch.int16)
        )
    with pytest.raises(ValueError, match="int16"):
        kahan_split_(torch.zeros(3), torch.bfloat16, torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kahan_split_(torch.zeros(3), torch.float8_e4m3fn, torch.zeros(3, dtype=torch.int16))


def test_the_noise_is_the_four_16_bit_quarters_of_each_64_bit_word_in_order():
    gen = torch.Generator().manual_seed(SEED)
    words = torch.empty(3, dtype=torch.int64).random_(-(2**63), None, generator=gen)
    expected = [(int(w) >> (16 * q)) & 0xFFFF for w in words.tolist() for q in range(4)][:11]
    noise = draw_noise(11, torch.Generator().manual_seed(SEED), torch.device("cpu"))
    assert noise.dtype == torch.int32 and noise.tolist() == expected


def plain_steps(model: nn.Module, opt: torch.optim.Optimizer, data) -> None:
    for x, y in data:
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_the_rescued_optimizer_state_dict_looks_stock():
    model = model_of(torch.bfloat16)
    opt = OPTS["adamw"](model.parameters())
    rescue = Rescue([opt], list(model.parameters()))
    rescue.cover(list(range(len(rescue.params))), "kahan")
    stock = model_of(torch.bfloat16)
    stock_opt = OPTS["adamw"](stock.parameters())
    plain_steps(model, opt, batches(3))
    plain_steps(stock, stock_opt, batches(3))
    ours, theirs = opt.state_dict(), stock_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for i, st in theirs["state"].items():
        assert ours["state"][i].keys() == st.keys()
        for k, v in st.items():
            assert (ours["state"][i][k].dtype, ours["state"][i][k].shape) == (v.dtype, v.shape)


def test_loading_a_state_dict_mid_run_continues_bitwise(tmp_path):
    def run(load: bool) -> list[torch.Tensor]:
        model = model_of(torch.bfloat16)
        opt = OPTS["adamw"](model.parameters())
        rescue = Rescue([opt], list(model.parameters()))
        rescue.cover(list(range(len(rescue.params))), "kahan")
        data = batches(8)
        plain_steps(model, opt, [next(data) for _ in range(4)])
        if load:  # replaces every state tensor: the rescue swaps the new ones
            torch.save(opt.state_dict(), tmp_path / "opt.pt")
            opt.load_state_dict(torch.load(tmp_path / "opt.pt"))
            low = [v for s in opt.state.values() for v in s.values() if v.dim()]
            assert all(v.dtype == torch.bfloat16 for v in low)
        plain_steps(model, opt, data)
        states = [v for s in opt.state.values() for v in s.values() if v.dim()]
        return [p.detach().clone() for p in model.parameters()] + states

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)


def test_a_step_that_raises_puts_the_low_precision_states_back():
    model = model_of(torch.bfloat16)
    opt = OPTS["adamw"](model.parameters())
    rescue = Rescue([opt], list(model.parameters()))
    rescue.cover(list(range(len(rescue.params))), "kahan")
    one_step_ops(model, opt)  # states exist (bf16)
    weight = model[0].weight
    before = dict(opt.state[weight])

    def boom(optimizer, args, kwargs):
        raise RuntimeError("boom")

    handle = opt.register_step_pre_hook(boom)  # runs after the rescue swapped in fp32
    x, y = next(batches(1))
    loss_of(model, x, y).backward()
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    rescue.abort()  # what the Guard does when its step raised
    handle.remove()
    assert weight.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert all(opt.state[weight][k] is v for k, v in before.items())  # the same bf16 tensors
    opt.step()  # and the next step runs
    assert opt.state[weight]["exp_avg"].dtype == torch.bfloat16
