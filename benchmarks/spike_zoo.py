"""The planted-spike zoo: loss spikes of known mechanism planted in small GPT-like models, and
clean runs; what the Guard's detector and ``ag.autopsy`` say, next to two peers' rules.

Run: ``python benchmarks/spike_zoo.py [--seeds 3] [--clean-steps 2000] [--json OUT]``.

Every run trains a one- or two-block decoder (token embedding, causal attention with separate
``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, an MLP ``fc`` / ``proj``, ``lm_head``) in bf16
autocast with AdamW on a synthetic next-token task, one param group per module (so an LR can be
planted in one layer). At window ``T`` (after the detector's warm-up) the loss spikes by one of:

==========================  ================================================================
``outlier_batch``           two of the eight sequences of batch ``T`` get adversarial targets
``update_outlier``          the LR of ``blocks.0.mlp.fc`` is 300x for window ``T - 1``
``attention_logit_growth``  the LR of ``blocks.0.attn.q_proj`` and ``k_proj`` is 3000x at ``T - 1``
``output_logit_divergence`` the LR of ``lm_head`` is 300x for window ``T - 1``
``adam_second_moment``      98% of ``blocks.0.mlp.proj``'s Adam ``exp_avg_sq`` decayed to 0
                            after window ``T - 2``'s update (an ``on_applied`` callback, so the
                            snapshot after ``T - 2`` holds it and the autopsy can replay it)
==========================  ================================================================

The peers' rules, reimplemented on the same losses: Megatron-style (a loss above 10x the largest
loss of the first 50 windows) and OLMo-style (a loss above the mean + 6 standard deviations of
the last 128 windows, after 20). A detection counts at window ``T``. Clean runs (5 models) count
false triggers per rule. Measured on a loaded 2-core CPU: the timings are not the point.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from collections import deque
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag

T = 80
VOCAB, SEQ, BATCH = 48, 16, 8
MECHANISMS = (
    "outlier_batch",
    "update_outlier",
    "attention_logit_growth",
    "output_logit_divergence",
    "adam_second_moment",
)
EXPECTED_LAYER = {
    "outlier_batch": None,
    "update_outlier": {"blocks.0.mlp.fc"},
    "attention_logit_growth": {"blocks.0.attn.q_proj", "blocks.0.attn.k_proj"},
    "output_logit_divergence": {"lm_head"},
    "adam_second_moment": {"blocks.0.mlp.proj"},
}


# ---------------------------------------------------------------------- the model
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc", nn.Linear(d, 4 * d))
        self.mlp.add_module("act", nn.GELU())
        self.mlp.add_module("proj", nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, d: int = 32, depth: int = 1, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(SEQ, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).float().reshape(-1, VOCAB), targets.reshape(-1))


class Task:
    """A fixed random Markov chain over the vocabulary (each token has 3 likely successors)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.next = torch.randint(0, VOCAB, (VOCAB, 3), generator=g)

    def batch(self, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        seq = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for i in range(SEQ):
            pick = torch.randint(0, 3, (BATCH,), generator=g)
            seq[:, i + 1] = self.next[seq[:, i], pick]
        return seq[:, :-1], seq[:, 1:]


def _groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    by_module: dict[str, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        by_module.setdefault(name.rsplit(".", 1)[0] if "." in name else name, []).append(p)
    return [{"params": ps, "lr": lr, "name": m} for m, ps in by_module.items()]


# ---------------------------------------------------------------------- peers' rules
class Megatron:
    """A loss above 10x the largest loss of the first 50 windows."""

    def __init__(self) -> None:
        self.early: list[float] = []

    def __call__(self, loss: float) -> bool:
        if len(self.early) < 50:
            self.early.append(loss)
            return False
        return loss > 10 * max(self.early)


class Olmo:
    """A loss above mean + 6 std of the last 128 windows (after 20); flagged losses stay out."""

    def __init__(self) -> None:
        self.window: deque[float] = deque(maxlen=128)

    def __call__(self, loss: float) -> bool:
        if len(self.window) >= 20:
            mean, std = statistics.fmean(self.window), statistics.pstdev(self.window)
            if loss > mean + 6 * std:
                return True
        self.window.append(loss)
        return False


# ---------------------------------------------------------------------- one run
def run(mechanism: str | None, seed: int, steps: int, d: int = 32, depth: int = 1) -> dict:
    torch.manual_seed(seed)
    model = TinyGPT(d, depth)
    opt = torch.optim.AdamW(_groups(model, 3e-3), lr=3e-3)
    # a snapshot after window T - 2 (= 78): the replay starts right before the planted window
    guard = ag.Guard(model, opt, precision="bf16", on_spike="skip", snapshot_every=T - 2)
    if mechanism == "adam_second_moment":  # after window T - 2's update, before its snapshot

        def decay(result: Any) -> None:
            if result.step != T - 2:
                return
            g = torch.Generator().manual_seed(seed)
            for p in model.blocks[0].mlp.proj.parameters():
                v = opt.state[p]["exp_avg_sq"]
                v.mul_((torch.rand(v.shape, generator=g) < 0.02).to(v.dtype))

        guard.on_applied(decay)
    task = Task(seed)
    groups = {g["name"]: g for g in opt.param_groups}
    peers = {"megatron": Megatron(), "olmo": Olmo()}
    peer_hits: dict[str, list[int]] = {k: [] for k in peers}
    losses = []
    for step in range(1, steps + 1):
        batch = task.batch(step, seed)
        for g in opt.param_groups:
            g["lr"] = 3e-3
        if mechanism == "outlier_batch" and step == T:
            tokens, targets = batch[0].clone(), batch[1].clone()
            with torch.no_grad(), guard.autocast():
                guess = model(tokens[:2]).argmax(-1)
            targets[:2] = (guess + VOCAB // 2) % VOCAB  # confidently wrong
            batch = (tokens, targets)
        if step == T - 1 and mechanism in ("update_outlier", "attention_logit_growth"):
            names = (
                ["blocks.0.mlp.fc"]
                if mechanism == "update_outlier"
                else ["blocks.0.attn.q_proj", "blocks.0.attn.k_proj"]
            )
            for n in names:
                groups[n]["lr"] = 3e-3 * (300 if mechanism == "update_outlier" else 3000)
        if step == T - 1 and mechanism == "output_logit_divergence":
            groups["lm_head"]["lr"] = 3e-3 * 300
        with guard.autocast():
            loss = loss_fn(model, batch)
        guard.backward(loss)
        guard.step(batch=batch, loss_fn=loss_fn)
        value = float(loss.detach())
        losses.append(value)
        for k, rule in peers.items():
            if rule(value):
                peer_hits[k].append(step)
    guard.settle_pending()
    ours = [e.step for e in guard.flight_recorder.events]
    out: dict[str, Any] = {
        "mechanism": mechanism,
        "seed": seed,
        "ours": ours,
        "peers": peer_hits,
        "spike_ratio": (losses[T - 1] / statistics.fmean(losses[T - 11 : T - 1]))
        if mechanism
        else None,
    }
    if mechanism is not None and T in ours:
        diag = next(d for d in ag.autopsy(guard) if d.step == T)
        out.update(
            diagnosis=diag.mechanism,
            layer=diag.layer,
            verified=diag.verified,
            removed_by=diag.evidence.get("removed_by"),
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--clean-steps", type=int, default=2000, help="steps of each clean run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    rows = [run(m, s, T + 5) for m in MECHANISMS for s in range(args.seeds)]
    print(
        f"{'mechanism':26} {'seed':>4} {'ratio':>6} {'ours':>5} {'megatron':>8} {'olmo':>5} "
        f"{'autopsy':26} {'layer':22} {'verified':>8}"
    )
    for r in rows:
        hit = T in r["ours"]
        print(
            f"{r['mechanism']:26} {r['seed']:4} {r['spike_ratio']:6.2f} "
            f"{'yes' if hit else 'no':>5} "
            f"{'yes' if T in r['peers']['megatron'] else 'no':>8} "
            f"{'yes' if T in r['peers']['olmo'] else 'no':>5} {str(r.get('diagnosis')):26} "
            f"{str(r.get('layer')):22} {str(r.get('verified')):>8}"
        )
    n = len(rows)
    detected = sum(T in r["ours"] for r in rows)
    right = sum(r.get("diagnosis") == r["mechanism"] for r in rows)
    layered = [r for r in rows if EXPECTED_LAYER[r["mechanism"]] is not None]
    layer_ok = sum(r.get("layer") in EXPECTED_LAYER[r["mechanism"]] for r in layered)
    verified = sum(bool(r.get("verified")) for r in rows)
    clean = [
        run(None, 100 + i, args.clean_steps, d=d, depth=depth)
        for i, (d, depth) in enumerate([(32, 1), (48, 1), (32, 2), (64, 1), (48, 2)])
    ]
    total = len(clean) * args.clean_steps
    false = {
        "ours": sum(len(r["ours"]) for r in clean),
        "megatron": sum(len(r["peers"]["megatron"]) for r in clean),
        "olmo": sum(len(r["peers"]["olmo"]) for r in clean),
    }
    peers_detected = {k: sum(T in r["peers"][k] for r in rows) for k in ("megatron", "olmo")}
    print(
        f"\ndetected: ours {detected}/{n}, megatron-style {peers_detected['megatron']}/{n}, "
        f"olmo-style {peers_detected['olmo']}/{n}\n"
        f"autopsy: mechanism right {right}/{n}, layer right {layer_ok}/{len(layered)}, "
        f"counterfactual removed the spike {verified}/{n}\n"
        f"false triggers over {total} clean steps (5 models): ours {false['ours']}, "
        f"megatron-style {false['megatron']}, olmo-style {false['olmo']}\n"
        f"({time.perf_counter() - start:.0f} s)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "clean": clean, "false": false}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
