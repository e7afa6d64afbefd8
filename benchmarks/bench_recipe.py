"""``ag.recipe_search`` against fixed recipes, on an outlier MLP and a GPT-tiny with SwiGLU and
planted outlier features (every format emulated: numerics, not speed).

For each model: the search runs on one full run's batches (``--steps``) with ``budget=0.1``;
then every recipe (all-MXFP8, all-NVFP4, first/last Linear in bf16 with NVFP4 between,
``plan.recipe()``, the searched one) trains a held-out run of ``--long`` steps per seed, and is
judged against bf16's run of the same seed with the issue's rule: within
``max(3 sigma of bf16, 0.5% of bf16's loss)``, sigma bf16's run-to-run spread (seeds s, s + 1).
Reported: the share of matmul FLOPs in NVFP4, the search's training steps as a share of one run,
and fails out of the seeds; each seed's gaps go to stderr as the seed ends (a run cut short
still counts its seeds). Run: ``python benchmarks/bench_recipe.py [--steps 120] [--long 240]
[--seeds 3]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings

import torch
from torch import nn

import ampguard as ag
from ampguard.demo.fp8_model import MassiveActivation
from ampguard.experiments import _recipe_search as _search
from ampguard.experiments._fidelity_score import fidelity_score
from ampguard.experiments._fp8 import _tail
from ampguard.experiments._recipe_search import _flop_share, _train
from ampguard.fp8._fidelity import gradient_fidelity as ag_fidelity
from ampguard.fp8._fidelity import lost_progress

FORMATS = ("mxfp8", "nvfp4")
READINGS: list[dict] = []  # the rank check's meter readings (--rank-dump)


# ---------------------------------------------------------------------- the models
class OutlierMLP(nn.Module):
    """in -> 64 -> 128 -> 128 -> 512 -> 128 -> out, GELU between (planted): every 16th sample
    300x the others on ``l1``'s input (a row outlier: the weight gradient's blocks along the
    batch flush the other samples) and a fixed 100x feature on ``l2``'s input (a column outlier:
    the forward's blocks flush the 15 features beside it). The wide layers ``l3``/``l4`` hold
    most of the FLOPs and are healthy."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(64, 128), nn.Linear(128, 128)
        self.l2, self.l3 = nn.Linear(128, 128), nn.Linear(128, 512)
        self.l4, self.out = nn.Linear(512, 128), nn.Linear(128, 16)
        self.spike = MassiveActivation(128, channel=5, value=100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = nn.functional.gelu
        h = act(self.l0(x))
        s = torch.ones(h.shape[0], 1, dtype=h.dtype)
        s[::16] = 300.0
        h = act(self.l1(h * s)) / s
        h = act(self.l2(self.spike(h)))
        h = act(self.l4(act(self.l3(h))))
        return self.out(h)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, outlier: float) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.gate, self.up, self.down = (
            nn.Linear(d, 2 * d),
            nn.Linear(d, 2 * d),
            nn.Linear(2 * d, d),
        )
        self.heads = heads
        self.spike = MassiveActivation(2 * d, channel=3, value=outlier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.n2(x)
        return x + self.down(self.spike(nn.functional.silu(self.gate(h)) * self.up(h)))


class GPTTiny(nn.Module):
    """token embedding -> 2 blocks (attention, SwiGLU with a planted outlier feature on the
    down projection's input) -> head."""

    def __init__(self, vocab: int = 128, d: int = 128, seq: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, 4, 100.0), Block(d, 4, 100.0)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


def _mlp_task(n: int, seed: int) -> list:
    """A fixed teacher, noisy targets (noise 1.0: an irreducible loss, as in real training);
    ``seed`` draws the inputs and the noise."""
    teacher = torch.randn(64, 16, generator=torch.Generator().manual_seed(100)) / 8
    gen = torch.Generator().manual_seed(100 + seed)
    out = []
    for _ in range(n):
        x = torch.randn(32, 64, generator=gen)
        out.append((x, torch.tanh(x @ teacher) + torch.randn(32, 16, generator=gen)))
    return out


def _gpt_task(n: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(200 + seed)
    out = []
    for _ in range(n):  # a sequence that counts up by a per-row stride: learnable
        start = torch.randint(0, 128, (8, 1), generator=gen)
        stride = torch.randint(1, 4, (8, 1), generator=gen)
        seq = (start + stride * torch.arange(33)) % 128
        noisy = torch.rand(seq.shape, generator=gen) < 0.2  # 20% random tokens: irreducible
        out.append(torch.where(noisy, torch.randint(0, 128, seq.shape, generator=gen), seq))
    return out


def mse(model: nn.Module, b: tuple) -> torch.Tensor:
    return nn.functional.mse_loss(model(b[0]).float(), b[1])


def next_token(model: nn.Module, b: torch.Tensor) -> torch.Tensor:
    logits = model(b[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))


MODELS = {
    "outlier MLP": (OutlierMLP, mse, _mlp_task),
    "GPT-tiny SwiGLU": (GPTTiny, next_token, _gpt_task),
}


# ---------------------------------------------------------------------- the comparison
def _linears(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _fixed(model: nn.Module, loss_fn, batch) -> dict[str, dict[str, str]]:
    names = _linears(model)
    plan = ag.fp8_plan(model, loss_fn, batch, formats=FORMATS)
    ends = {names[0], names[-1]}
    return {
        "all-MXFP8": {n: "mxfp8" for n in names},
        "all-NVFP4": {n: "nvfp4" for n in names},
        "first/last bf16": {n: "bf16" if n in ends else "nvfp4" for n in names},
        "plan.recipe()": plan.recipe(),
    }


def _gap_table(
    factory, loss_fn, held, recipes, seeds, first: int = 0, known=None
) -> dict[str, list[float]]:
    """Every recipe's final-loss gap to bf16 per seed (seeds ``first`` on), and the judge's
    tolerance (key ""). ``known``: gaps already measured from the same ``first``, per label,
    taken instead of training those seeds again."""
    known = known or {}
    run = range(first, first + seeds)
    bf16 = [_tail(_train(factory, loss_fn, held, {}, s, _opt))[1] for s in run]
    sigma = statistics.stdev(bf16) if seeds > 1 else 0.0
    out: dict[str, list[float]] = {"": [max(3 * sigma, 0.005 * b) for b in bf16]}
    for i, s in enumerate(run):  # seed by seed, each seed's gaps to stderr: a cut run counts
        for label, recipe in recipes.items():
            done = known.get(label, ())
            gap = (
                done[i] if i < len(done) else _train_gap(factory, loss_fn, held, recipe, s, bf16[i])
            )
            out.setdefault(label, []).append(gap)
        print(f"seed {s}: tolerance {out[''][i]:.4f}, bf16 {bf16[i]:.4f}, gaps "
              + ", ".join(f"{k} {v[i]:+.4f}" for k, v in out.items() if k), file=sys.stderr,
              flush=True)  # fmt: skip
    return out


def _train_gap(factory, loss_fn, held, recipe, seed: int, bf16: float) -> float:
    return _tail(_train(factory, loss_fn, held, recipe, seed, _opt))[1] - bf16


def _fails(gaps: list[float], tol: list[float]) -> int:
    return sum(not (math.isfinite(g) and g <= t) for g, t in zip(gaps, tol, strict=True))


def _meter_score(factory, loss_fn, batches, recipe, steps: int, seed: int = 0) -> tuple:
    """The fidelity meter after ``steps`` bf16 steps (model and steps under ``seed``), read
    three ways: the sum over layers of the squared relative gradient error plus the share of
    lost input features (the first score), ``lost_progress`` plus the lost inputs, and
    ``fidelity_score`` (the worst layer's direction error plus the lost inputs)."""
    torch.manual_seed(seed)
    model = factory()
    opt = _opt(model.parameters())
    for b in batches[:steps]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, b)
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    meter = ag_fidelity(model, loss_fn, batches[steps : steps + 2], recipe)
    READINGS.append({"recipe": recipe, "meter": meter,
                     "params": {n: m.weight.numel() for n, m in model.named_modules()
                                if isinstance(m, nn.Linear)}})  # fmt: skip
    old = sum(m["rel_error"] ** 2 + m["lost_inputs"] for m in meter.values())
    progress = lost_progress(meter) + sum(m["lost_inputs"] for m in meter.values())
    return old, progress, fidelity_score(meter)


def _rank_recipes(names: list[str], have: int) -> dict[str, dict[str, str]]:
    """Recipes for the rank check besides the table's ``have``: each layer alone in NVFP4,
    then alone in MXFP8 (others bf16), until there are at least 12."""
    out = {f"{n} nvfp4": {n: "nvfp4"} for n in names}
    for n in names:
        if have + len(out) >= 12:
            break
        out[f"{n} mxfp8"] = {n: "mxfp8"}
    return out


def run(
    name: str,
    steps: int,
    long: int,
    seeds: int,
    rank_seeds: tuple[int, int],
    dump: str = "",
    first: int = 0,
) -> None:
    """Print the model's rows as they come (a row per recipe, the search, the rank check of
    ``rank_seeds``: the final gap's seeds, the meter's seeds; 0 seeds: no rank check)."""
    rank_seeds, meter_seeds = rank_seeds
    cls, loss_fn, task = MODELS[name]

    def factory() -> nn.Module:
        torch.manual_seed(torch.initial_seed())
        return cls()

    batches = task(steps, 0)
    t0 = time.perf_counter()
    meter_passes = _count_passes()
    cert = ag.recipe_search(factory, loss_fn, batches, formats=FORMATS, budget=0.1)
    search_s = time.perf_counter() - t0
    trained = sum(1 for h in cert.branches if h["kind"] != "meter") + 2
    passes = meter_passes() + 1  # and the plan's traced batch
    torch.manual_seed(0)
    model = factory()
    recipes = {**_fixed(model, loss_fn, batches[0]), "searched": cert.recipe}
    held = task(long, 1)  # held-out batches, --long steps (10x the search's budget)
    t0 = time.perf_counter()
    gaps = _gap_table(factory, loss_fn, held, recipes, seeds)
    tol = gaps.pop("")

    def emit(row: str) -> None:
        print(row, flush=True)

    for label, recipe in recipes.items():
        share = _flop_share(model, loss_fn, batches[0], recipe).get("nvfp4", 0.0)
        worst = max(g / t for g, t in zip(gaps[label], tol, strict=True))
        emit(f"| {name} | {label} | {share:.0%} | {_fails(gaps[label], tol)}/{seeds} "
                    f"| {worst:.2f} |")  # fmt: skip
    emit(
        f"| {name} | (search: {trained} branches x {cert.steps} steps = "
        f"{trained * cert.steps / steps:.0%} of a run, + {passes} meter passes = "
        f"{(trained * cert.steps + passes) / steps:.0%}, {search_s:.0f} s; passed={cert.passed}; "
        f"held-out {time.perf_counter() - t0:.0f} s) | | | |"
    )
    if rank_seeds:
        reuse = {k: v[:rank_seeds] for k, v in gaps.items()} if first == 0 else {}
        emit(_rank_check(name, factory, loss_fn, held, model, recipes, reuse,
                         (first, rank_seeds, meter_seeds), dump))  # fmt: skip


def _rank_check(name, factory, loss_fn, held, model, recipes, reuse, seeds, dump) -> str:
    """The rank check's row: every recipe's meter reading at 5% of the held-out run, on each of
    ``meter`` seeds, ranked against the recipe's final gap to bf16 averaged over ``truth``
    seeds from ``first`` (the table's gaps in ``reuse`` stand in for their recipes' runs), with
    the truth's own noise ceiling: its halves' Spearman rho, stepped up by Spearman-Brown to the
    reliability of the whole mean, whose square root estimates the most rho a score can expect
    (an estimate: with few seeds a rho can land above it)."""
    first, truth, meter = seeds
    ranked = {**recipes, **_rank_recipes(_linears(model), len(recipes))}
    final = _gap_table(factory, loss_fn, held, ranked, truth, first, reuse)
    final.pop("")
    labels = list(ranked)
    gap = [statistics.mean(final[k]) for k in labels]
    r_half, reliability = _split_half([final[k][:truth] for k in labels])
    early = max(1, len(held) // 20)  # 5% of the held-out run
    rhos = []  # per meter seed: (summed rel. error, lost_progress, fidelity_score)
    for s in range(first, first + meter):
        score = {k: _meter_score(factory, loss_fn, held, r, early, s) for k, r in ranked.items()}
        rhos.append([_spearman([score[k][i] for k in labels], gap) for i in range(3)])
    if dump:
        with open(dump, "w") as f:
            json.dump({"labels": labels, "gap": gap, "gaps": final, "readings": READINGS}, f)
    per = ", ".join(f"{r[2]:.2f}" for r in rhos)
    med = [statistics.median(r[i] for r in rhos) for i in range(3)]
    return (
        f"| {name} | (meter at {early} steps ranks {len(labels)} recipes by their final gap "
        f"over seeds {first}-{first + truth - 1}: Spearman rho, median over meter seeds "
        f"{first}-{first + meter - 1}, {med[2]:.2f} by fidelity_score ({per}), {med[0]:.2f} by "
        f"the summed squared relative error, {med[1]:.2f} by lost_progress; the gap's noise "
        f"ceiling {math.sqrt(reliability):.2f} (halves' rho {r_half:.2f}, Spearman-Brown "
        f"reliability {reliability:.2f})) | | | |"
    )


def _count_passes():
    """Count the search's meter passes (wraps the two functions the search calls: one
    forward+backward pass per shadow micro-batch each); returns a reader of the count."""
    real = _search.gradient_fidelity, _search.reference_gradients
    count = [0]

    def counting(fn):
        def counted(model, loss_fn, batches, *args, **kwargs):
            count[0] += len(batches)
            return fn(model, loss_fn, batches, *args, **kwargs)

        return counted

    _search.gradient_fidelity, _search.reference_gradients = map(counting, real)

    def read() -> int:
        _search.gradient_fidelity, _search.reference_gradients = real
        return count[0]

    return read


def _split_half(gaps: list[list[float]]) -> tuple[float, float]:
    """``(rho, reliability)`` of per-recipe seed gaps: the Spearman rho between the recipes'
    mean gaps over the first and the second half of the seeds, and the Spearman-Brown
    reliability of the mean over all of them, ``2 rho / (1 + rho)`` (nan below 2 seeds or for a
    rho <= 0). Its square root estimates the most rho a score can expect against those gaps."""
    half = min(len(g) for g in gaps) // 2
    if not half:
        return math.nan, math.nan
    rho = _spearman(
        *([statistics.mean(g[a:b]) for g in gaps] for a, b in ((0, half), (half, 2 * half)))
    )
    return rho, (2 * rho / (1 + rho) if rho > 0 else math.nan)


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else math.nan


class _L:
    def __init__(self, losses: list[float]) -> None:
        self.losses = losses


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3)


def gpt2(steps: int) -> str:
    """The search once on Hugging Face's GPT-2 code (2 layers, width 128, vocab 512, the
    Conv1D layers as Linear), next-token loss on the GPT-tiny's noisy counting sequences."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512
    )

    def factory() -> nn.Module:
        torch.manual_seed(torch.initial_seed())
        return ag.conv1d_to_linear(transformers.GPT2LMHeadModel(config))

    def loss_fn(model: nn.Module, b: torch.Tensor) -> torch.Tensor:
        return model(input_ids=b, labels=b).loss.float()

    t0 = time.perf_counter()
    cert = ag.recipe_search(factory, loss_fn, _gpt_task(steps, 0), formats=FORMATS)
    trained = sum(1 for h in cert.branches if h["kind"] != "meter") + 2
    return (
        f"HF GPT2LMHeadModel (2 layers, 128 wide): {cert.summary()}; search {trained} x "
        f"{cert.steps} steps = {trained * cert.steps / steps:.0%} of {steps}, "
        f"{time.perf_counter() - t0:.0f} s; kept high: "
        f"{sorted(n for n, f in cert.recipe.items() if f != 'nvfp4')}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300, help="one full run (the search's batches)")
    ap.add_argument("--long", type=int, default=None, help="held-out steps (default --steps)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--rank-seeds", type=int, default=6,
                    help="seeds of the rank check's final gap (0: no rank check)")  # fmt: skip
    ap.add_argument("--meter-seeds", type=int, default=3,
                    help="seeds the rank check reads the meter on (rho: their median)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="3 seeds, 150 steps, no rank check")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rank-first", type=int, default=0,
                    help="the rank check's first seed (held-out seeds: 3)")  # fmt: skip
    ap.add_argument("--rank-dump", default="", help="write the rank check's readings (JSON)")
    ap.add_argument("--gpt2", action="store_true", help="only the search on HF GPT-2")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seeds, args.rank_seeds = 150, 3, 0
    long = args.long or args.steps
    if args.gpt2:
        warnings.filterwarnings("ignore")
        torch.set_num_threads(1)
        print(gpt2(args.steps))
        return
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print("| model | recipe | matmul FLOPs in NVFP4 | held-out fails | worst gap / tolerance |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        rank = args.rank_seeds, min(args.meter_seeds, args.rank_seeds)
        run(name, args.steps, long, args.seeds, rank, args.rank_dump, args.rank_first)


if __name__ == "__main__":
    main()
