"""Stagnation rescue: pure low-precision weights against the rescue and fp32 master weights.

Models: a pure-bf16 MLP, a pure-bf16 GPT-tiny (2 blocks, width 32, next-token loss on a fixed
random Markov chain), a ``.half()`` MLP and ``hf``: transformers' own ``GPT2LMHeadModel(GPT2Config(
n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=512))`` in bf16 (real public code;
dropout off, sequences of 32 tokens from a 512-token Markov chain, batch 8). Optimizers: SGD +
momentum, AdamW, torch's Adafactor and a Lion written here. Methods (every one through
``ampguard.Guard``, ``precision="bf16"``):

- ``bf16``: the weights and states in the model's dtype, nothing rescued;
- ``torchao-sr``: torchao's ``_AdamW(bf16_stochastic_round=True)`` (AdamW on bf16 models only);
- ``kahan``: ``stagnation_rescue="kahan"`` (every layer);
- ``auto``: ``stagnation_rescue="auto"`` (the layers the probe finds, Kahan within the budget);
- ``fp32``: fp32 master weights (the model in float32, autocast for the math).

Columns: the final loss (mean of the last 10% of steps), the persistent bytes per parameter beyond
the low-precision weights and states (fp32 master weights: a 4-byte copy), the step time over the
``bf16`` row of the same model and optimizer, the share of the loss gap between ``bf16`` and
``fp32`` that the method closes (the step times: CPU time of one torch thread, medians of 15
interleaved rounds of at least 10 steps and 0.1 s after training), and the share of AdamW's
decoupled weight decay applied (a decay-only run: zero gradients, ``lr=1e-3``,
``weight_decay=1e-2``, 200 steps, the stored weight plus its Kahan buffer; ``auto`` with the
layers it chose in training). The ``.half()`` model's AdamW uses ``eps=1e-4``: the default
1e-8 is 0 in fp16, and pure fp16 turns NaN (AG366).

    python benchmarks/bench_stagnation.py --steps 2000      # the issue's length
    python benchmarks/bench_stagnation.py --steps 300 --models mlp   # quick

Runtime at 2,000 steps, one torch thread: about 2 CPU minutes per small model (mlp, half) with
the four optimizers, about 1 per optimizer for gpt and 5 for ``hf``; on this project's shared
2-core CPU under a load of 8-10 the wall time was 10-20x that (``--models`` / ``--optimizers``
run a part).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard.core.rounding import kahan_read

VOCAB, SEQ, WIDTH = 32, 16, 32


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): ``p -= lr * (sign(b1*m + (1-b1)*g) + wd*p)``,
    ``m = b2*m + (1-b2)*g``."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - b2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPTTiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tok(idx) + self.pos))


HF_VOCAB, HF_SEQ = 512, 32  # the HF GPT-2: n_positions=64, sequences of 32 tokens


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPTTiny()
    if name == "hf":  # real public code: transformers' GPT-2 (dropout off: a deterministic run)
        import transformers

        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, n_positions=64, vocab_size=HF_VOCAB,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )


BATCH = {"mlp": 64, "half": 64, "gpt": 16, "hf": 8}


def data(name: str, steps: int):
    gen = torch.Generator().manual_seed(1)
    if name in ("gpt", "hf"):
        vocab, length = (VOCAB, SEQ) if name == "gpt" else (HF_VOCAB, HF_SEQ)
        trans = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 3, -1)
        for _ in range(steps):
            seq = [torch.randint(vocab, (BATCH[name],), generator=gen)]
            for _ in range(length):
                seq.append(torch.multinomial(trans[seq[-1]], 1, generator=gen).squeeze(1))
            s = torch.stack(seq, 1)
            yield s[:, :-1], s[:, 1:]
    else:
        teacher = torch.randn(32, 8, generator=gen) / 4
        for _ in range(steps):
            x = torch.randn(BATCH[name], 32, generator=gen)
            yield x, torch.tanh(x @ teacher * 2)


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))
    if name == "hf":
        return F.cross_entropy(model(x).logits.float().reshape(-1, HF_VOCAB), y.reshape(-1))
    return F.mse_loss(model(x.to(dtype)).float(), y)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=3e-3),
    "lion": lambda ps: Lion(ps, lr=2e-5, weight_decay=0.1),
}
LOW = {"mlp": torch.bfloat16, "gpt": torch.bfloat16, "half": torch.float16, "hf": torch.bfloat16}


def train(model_name: str, opt_name: str, method: str, steps: int) -> dict | None:
    low = LOW[model_name]
    model = make_model(model_name)
    dtype = torch.float32 if method == "fp32" else low
    model = model.to(dtype)
    if method == "torchao-sr":
        if opt_name != "adamw" or low != torch.bfloat16:
            return None
        try:
            from torchao.optim import _AdamW
        except ImportError:
            return None
        opt = _AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, bf16_stochastic_round=True)
    elif opt_name == "adamw" and low == torch.float16:  # 1e-8 is 0 in fp16: NaN (AG366)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, eps=1e-4)
    else:
        opt = OPTIMIZERS[opt_name](model.parameters())
    rescue = method if method in ("kahan", "auto") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = ag.Guard(model, opt, precision="bf16", stagnation_rescue=rescue)
    losses = []
    batch = None
    for x, y in data(model_name, steps):
        batch = (x, y)
        with guard.autocast():
            loss = loss_of(model_name, model, x, y, dtype)
        guard.backward(loss)
        guard.step()
        losses.append(loss.detach())
    tail = max(1, steps // 10)
    final = float(torch.stack(losses[-tail:]).mean())
    extra = 4.0 if method == "fp32" else guard.rescue.bytes_per_param() if guard.rescue else 0.0
    decisions = dict(guard.rescue.decisions) if guard.rescue else {}

    def step() -> None:  # one more training step on the last batch (timed, interleaved)
        assert batch is not None
        with guard.autocast():
            loss = loss_of(model_name, model, *batch, dtype)
        guard.backward(loss)
        guard.step()

    trained = copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.state_dict(), "guard": guard.state_dict()}
    )

    def reset() -> None:  # back to the trained state (untimed, before each round)
        model.load_state_dict(trained["model"])
        opt.load_state_dict(copy.deepcopy(trained["opt"]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            guard.load_state_dict(copy.deepcopy(trained["guard"]))

    return {"loss": final, "bytes": extra, "decisions": decisions, "step": step, "reset": reset}


def interleaved_times(rows: dict, rounds: int = 15, least: float = 0.1) -> dict[str, float]:
    """Median CPU seconds per step of each method (this process, one torch thread), timed in
    alternating rounds: on a shared machine wall time swings by 10x, CPU time much less. A
    round is at least 10 steps and ``least`` CPU seconds of the plain step (a 1 ms step in
    rounds of 10 swung by 0.3x between methods that run the same operations). Each round
    starts from the trained state (model, optimizer and Guard restored, untimed): the timed
    steps repeat one batch, and 15 rounds of them in a row trained a `.half()` Adafactor run
    on into a non-finite weight (a ScaleCollapseError at its 616th extra step)."""
    times: dict[str, list[float]] = {m: [] for m, r in rows.items() if r is not None}
    first = next(iter(times))
    t0 = time.process_time()
    for _ in range(5):
        rows[first]["step"]()
    steps = max(10, math.ceil(least / max((time.process_time() - t0) / 5, 1e-6)))
    for _ in range(rounds):
        for m in times:
            rows[m]["reset"]()
            t0 = time.process_time()
            for _ in range(steps):
                rows[m]["step"]()
            times[m].append((time.process_time() - t0) / steps)
    return {m: sorted(t)[len(t) // 2] for m, t in times.items()}


def decay_share(model_name: str, method: str, decisions: dict) -> float:
    """Share of AdamW's decoupled decay applied over 200 zero-gradient steps."""
    low = LOW[model_name]
    model = make_model(model_name).to(torch.float32 if method == "fp32" else low)
    start = [p.detach().float().clone() for p in model.parameters()]
    eps = 1e-4 if low == torch.float16 else 1e-8  # 0/0 in fp16 otherwise
    if method == "torchao-sr":
        from torchao.optim import _AdamW

        opt = _AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, bf16_stochastic_round=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, eps=eps)
    rescue = "kahan" if method == "kahan" else "auto" if method == "auto" else None
    guard = ag.Guard(model, opt, precision="bf16", stagnation_rescue=rescue)
    if method == "auto" and guard.rescue is not None:  # the layers auto chose in training
        for layer, d in decisions.items():
            idx = [i for i, n in enumerate(guard.rescue.layers) if n == layer]
            guard.rescue.rescue.cover(idx, d["method"])
        guard.rescue.mode = None  # no new decisions on zero gradients
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    steps = 200
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    comp = guard.rescue.rescue.comp if guard.rescue else {}
    index = {id(p): i for i, p in enumerate(guard.rescue.rescue.params)} if guard.rescue else {}
    done = want = 0.0
    for p, s in zip(model.parameters(), start, strict=True):
        value = p.detach().float()
        i = index.get(id(p))
        if i is not None and i in comp:
            value = kahan_read(p.detach(), comp[i])
        done += float((s - value).abs().sum())
        want += float(s.abs().sum()) * (1 - (1 - 1e-5) ** steps)
    return done / want if want else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--models", default="mlp,gpt,half")
    ap.add_argument("--optimizers", default="sgd,adamw,adafactor,lion")
    ap.add_argument("--batch", type=int, default=None, help="batch size (MLPs 64, GPT 16)")
    args = ap.parse_args()
    if args.batch:
        BATCH.update(dict.fromkeys(BATCH, args.batch))
    torch.set_num_threads(1)  # CPU time per step means one thread's work
    began = time.perf_counter()
    methods = ["bf16", "torchao-sr", "kahan", "auto", "fp32"]
    print(f"steps={args.steps} batch={BATCH}")
    print(
        "| model | optimizer | method | final loss | gap closed | bytes/param | step time "
        "| WD applied |"
    )
    print("|---|---|---|---|---|---|---|---|")
    wd_cache: dict = {}
    compact: list[str] = []
    for model_name in args.models.split(","):
        for opt_name in args.optimizers.split(","):
            rows = {m: train(model_name, opt_name, m, args.steps) for m in methods}
            base, ref = rows["bf16"], rows["fp32"]
            assert base is not None and ref is not None
            timed = interleaved_times(rows)
            for m in methods:
                r = rows[m]
                if r is None:
                    continue
                gap = base["loss"] - ref["loss"]
                # no gap to close (pure low precision within 1% of fp32, or ahead): "n/a"
                closed = (base["loss"] - r["loss"]) / gap if gap > 0.01 * ref["loss"] else math.nan
                r["closed"], r["time"] = closed, timed[m] / timed["bf16"]
                wd = ""
                if opt_name == "adamw":
                    key = (model_name, m)
                    if key not in wd_cache or m == "auto":
                        wd_cache[key] = decay_share(model_name, m, r["decisions"])
                    wd = f"{wd_cache[key]:.0%}"
                    r["wd"] = wd
                print(
                    f"| {model_name} | {opt_name} | {m} | {r['loss']:.4f} | "
                    f"{pct(closed)} | {r['bytes']:.2f} | {r['time']:.2f}x | {wd} |",
                    flush=True,
                )
            compact.append(summary(model_name, opt_name, rows))
    print("\ncompact (gap closed / extra bytes per parameter / step time over pure bf16):")
    print(
        "| model | optimizer | loss bf16 -> fp32 | torchao SR AdamW | Kahan, every layer "
        '| "auto" | WD applied (bf16 / torchao / Kahan / auto) |'
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(compact))
    print(f"\nran {time.perf_counter() - began:.0f} s (wall)")


def pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"


def summary(model_name: str, opt_name: str, rows: dict) -> str:
    def cell(m: str) -> str:
        r = rows.get(m)
        if r is None:
            return "-"
        return f"{pct(r['closed'])} / {r['bytes']:.2f} B / {r['time']:.2f}x"

    wd = (
        " / ".join(
            rows[m].get("wd", "") if rows.get(m) else "-"
            for m in ("bf16", "torchao-sr", "kahan", "auto")
        )
        if opt_name == "adamw"
        else ""
    )
    return (
        f"| {model_name} | {opt_name} | {rows['bf16']['loss']:.3f} -> {rows['fp32']['loss']:.3f} "
        f"| {cell('torchao-sr')} | {cell('kahan')} | {cell('auto')} | {wd} |"
    )


if __name__ == "__main__":
    main()
