"""The planted-spike zoo: loss spikes of known mechanism planted in small GPT-like models and a
real HF GPT-2, and clean runs; what the Guard's detector and ``ag.autopsy`` say, next to two
peers' rules.

Run: ``python benchmarks/spike_zoo.py [--seeds 12] [--tune-seeds 3] [--clean-steps 2000]
[--quick] [--clean-only] [--json OUT]`` (the default: 66 cases and 10,000 clean steps, about
15 minutes on a loaded 2-core CPU; ``--quick``: 2 seeds, 300 clean steps a model, about 2).

Every run trains in bf16 autocast with AdamW (one param group per module, so an LR can be
planted in one layer) on a second-order chain (the models must attend to the previous token):
a TinyGPT of one or two blocks (width 32 or 48; by seed) or Hugging Face's
``GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=64,
vocab_size=512))`` with its dropout. At window ``T`` (after the detector's warm-up) the loss
spikes by one mechanism, planted physically (the mechanism itself makes the spike):

==========================  ================================================================
``outlier_batch``           half of the sequences of batch ``T`` get wrong targets (the true
                            next token shifted by half the vocabulary: confidently wrong)
``update_outlier``          the LR of the first MLP's input layer is 1000x for window ``T - 1``
``attention_logit_growth``  the LR of the first block's query and key projections (GPT-2: its
                            fused ``c_attn``) is 3000x for window ``T - 1``: the attention
                            logits grow until the softmax saturates on the wrong position
``output_logit_divergence`` the LR of ``lm_head`` is 1000x for window ``T - 1``
``adam_second_moment``      98% of the first MLP's Adam ``exp_avg_sq`` decayed to 0 after
                            window ``T - 2``'s update (a layer whose gradient vanished for
                            long; an ``on_applied`` callback, so the snapshot holds it): Adam's
                            next step there is ``m / sqrt((1 - beta2) g^2)``
==========================  ================================================================

Seeds ``0 .. tune_seeds - 1`` are the ones the autopsy was developed on; the others are reported
apart (held out). The peers' rules, reimplemented on the same losses: Megatron-style (a loss
above 10x the largest loss of the first 50 windows) and OLMo-style (a loss above the mean + 6
standard deviations of the last 128 windows, after 20); they detect, they do not diagnose. A
detection counts at window ``T``. Clean runs (5 models, the GPT-2 among them, ``on_spike="warn"``
so the trajectory is the model's own) count each rule's triggers: false where the loss is under
1.5x the median of the 50 windows before, else a natural excursion of the clean run. Measured
on a loaded 2-core CPU: the timings are not the point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections import deque
from typing import Any

import torch
from _spike_models import VOCAB, Task, TinyGPT, gpt2, groups, loss_fn

import ampguard as ag

T = 160
LR = 3e-3
MECHANISMS = (
    "outlier_batch",
    "update_outlier",
    "attention_logit_growth",
    "output_logit_divergence",
    "adam_second_moment",
)
MODELS = ("tiny-32x1", "tiny-32x2", "tiny-48x1")  # a mechanism case's model, by seed
GPT2_CASES = ("update_outlier", "attention_logit_growth", "adam_second_moment")
CLEAN = ("tiny-32x1", "tiny-48x1", "tiny-32x2", "tiny-64x2", "gpt2")


def layers(kind: str) -> dict[str, list[str]]:
    """The layers each plant acts on, for model ``kind``."""
    if kind == "gpt2":
        h = "transformer.h.0"
        return {
            "update_outlier": [f"{h}.mlp.c_fc"],
            "attention_logit_growth": [f"{h}.attn.c_attn"],
            "output_logit_divergence": ["lm_head"],
            "adam_second_moment": [f"{h}.mlp.c_fc", f"{h}.mlp.c_proj"],
        }
    b = "blocks.0"
    return {
        "update_outlier": [f"{b}.mlp.fc"],
        "attention_logit_growth": [f"{b}.attn.q_proj", f"{b}.attn.k_proj"],
        "output_logit_divergence": ["lm_head"],
        "adam_second_moment": [f"{b}.mlp.fc", f"{b}.mlp.proj"],
    }


LR_PLANTS = {
    "update_outlier": 1000,
    "attention_logit_growth": 3000,
    "output_logit_divergence": 1000,
}


def build(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt2":
        return gpt2()
    d, depth = (int(v) for v in kind.split("-")[1].split("x"))
    return TinyGPT(d, depth)


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
def run(mechanism: str | None, seed: int, kind: str, steps: int) -> dict[str, Any]:
    model = build(kind, seed)
    opt = torch.optim.AdamW(groups(model, LR), lr=LR)
    # a snapshot after window T - 2: the replay starts right before the planted window
    # clean runs only warn: a skip would change the trajectory whose triggers are counted
    policy = "skip" if mechanism else "warn"
    guard = ag.Guard(model, opt, precision="bf16", on_spike=policy, snapshot_every=T - 2)
    named = dict(model.named_modules())
    plant = layers(kind).get(mechanism or "", [])
    if mechanism == "adam_second_moment":  # after window T - 2's update, before its snapshot

        def decay(result: Any) -> None:
            if result.step != T - 2:
                return
            g = torch.Generator().manual_seed(seed)
            for name in plant:
                for p in named[name].parameters():
                    v = opt.state[p]["exp_avg_sq"]
                    v.mul_((torch.rand(v.shape, generator=g) < 0.02).to(v.dtype))

        guard.on_applied(decay)
    task = Task(seed)
    by_name = {g["name"]: g for g in opt.param_groups}
    peers = {"megatron": Megatron(), "olmo": Olmo()}
    peer_hits: dict[str, list[int]] = {k: [] for k in peers}
    losses = []
    for step in range(1, steps + 1):
        tokens, targets = task.batch(step, seed)
        for g in opt.param_groups:
            g["lr"] = LR
        if mechanism == "outlier_batch" and step == T:
            targets = targets.clone()
            half = targets.shape[0] // 2
            targets[:half] = (targets[:half] + VOCAB // 2) % VOCAB  # confidently wrong
        if step == T - 1 and mechanism in LR_PLANTS:
            for name in plant:
                by_name[name]["lr"] = LR * LR_PLANTS[mechanism]
        batch = (tokens, targets)
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
    out: dict[str, Any] = {"mechanism": mechanism, "seed": seed, "model": kind, "ours": ours}
    out["peers"] = peer_hits
    if mechanism is None:
        out["excursion"] = {k: [_excursion(losses, t) for t in v] for k, v in peer_hits.items()}
        out["excursion"]["ours"] = [_excursion(losses, t) for t in ours]
        return out
    out["spike_ratio"] = losses[T - 1] / statistics.fmean(losses[T - 11 : T - 1])
    out["expected_layers"] = plant or None
    if T in ours:
        diag = next(d for d in ag.autopsy(guard) if d.step == T)
        out.update(
            diagnosis=diag.mechanism,
            layer=diag.layer,
            verified=diag.verified,
            removed_by=diag.evidence.get("removed_by"),
            replay=diag.evidence.get("replay"),
        )
    return out


NATURAL = 1.5  # a clean run's trigger at a loss >= 1.5x the median of the 50 windows before


def _excursion(losses: list[float], step: int) -> float:
    """Window ``step``'s loss over the median of the 50 windows before it."""
    before = losses[max(0, step - 51) : step - 1]
    return losses[step - 1] / statistics.median(before) if before else 1.0


def score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Detected, mechanism right, layer right (where the cause is a layer), verified."""
    layered = [r for r in rows if r["expected_layers"]]
    return {
        "n": len(rows),
        "detected": sum(T in r["ours"] for r in rows),
        "mechanism": sum(r.get("diagnosis") == r["mechanism"] for r in rows),
        "layered": len(layered),
        "layer": sum(r.get("layer") in r["expected_layers"] for r in layered),
        "verified": sum(bool(r.get("verified")) for r in rows),
        "megatron": sum(T in r["peers"]["megatron"] for r in rows),
        "olmo": sum(T in r["peers"]["olmo"] for r in rows),
    }


def _line(name: str, s: dict[str, Any]) -> str:
    n = s["n"]
    return (
        f"{name:18} n={n:<3} detected: ours {s['detected']}/{n}, megatron-style "
        f"{s['megatron']}/{n}, olmo-style {s['olmo']}/{n} | autopsy (ours only): mechanism "
        f"{s['mechanism']}/{n}, layer {s['layer']}/{s['layered']}, counterfactual removed the "
        f"spike {s['verified']}/{n}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=12, help="seeds per mechanism (tiny models)")
    ap.add_argument("--tune-seeds", type=int, default=3, help="seeds 0..N-1: tuned on")
    ap.add_argument("--gpt2-seeds", type=int, default=2, help="seeds per GPT-2 case")
    ap.add_argument("--clean-steps", type=int, default=2000, help="steps of each clean run")
    ap.add_argument("--quick", action="store_true", help="2 seeds, 1 GPT-2 seed, 300 clean steps")
    ap.add_argument("--clean-only", action="store_true", help="only the clean runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.gpt2_seeds, args.clean_steps = 2, 1, 300
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    cases = [(m, s, MODELS[s % len(MODELS)]) for m in MECHANISMS for s in range(args.seeds)]
    cases += [(m, s, "gpt2") for m in GPT2_CASES for s in range(args.gpt2_seeds)]
    rows = [] if args.clean_only else [run(m, s, k, T) for m, s, k in cases]
    print(
        f"{'mechanism':24} {'model':9} {'seed':>4} {'ratio':>6} {'ours':>4} {'mega':>4} "
        f"{'olmo':>4} {'autopsy':24} {'layer':26} {'verified':>8}"
    )
    for r in rows:
        yes = {k: "yes" if T in v else "no" for k, v in [("ours", r["ours"]), *r["peers"].items()]}
        print(
            f"{r['mechanism']:24} {r['model']:9} {r['seed']:4} {r['spike_ratio']:6.2f} "
            f"{yes['ours']:>4} {yes['megatron']:>4} {yes['olmo']:>4} "
            f"{str(r.get('diagnosis')):24} {str(r.get('layer')):26} {str(r.get('verified')):>8}"
        )
    clean = [run(None, 100 + i, kind, args.clean_steps) for i, kind in enumerate(CLEAN)]
    total = len(clean) * args.clean_steps
    rules = ("ours", "megatron", "olmo")
    false = {k: sum(x < NATURAL for r in clean for x in r["excursion"][k]) for k in rules}
    natural = {k: sum(x >= NATURAL for r in clean for x in r["excursion"][k]) for k in rules}
    tiny = [r for r in rows if r["model"] != "gpt2"]
    splits = {
        "all": score(rows),
        "tuned seeds": score([r for r in tiny if r["seed"] < args.tune_seeds]),
        "held-out seeds": score([r for r in tiny if r["seed"] >= args.tune_seeds]),
        "HF GPT-2": score([r for r in rows if r["model"] == "gpt2"]),
    }
    print()
    for name, s in splits.items():
        if s["n"]:
            print(_line(name, s))
    print(
        f"false triggers over {total} clean steps ({len(CLEAN)} models; a loss under "
        f"{NATURAL}x the median of the 50 windows before): ours {false['ours']}, "
        f"megatron-style {false['megatron']}, olmo-style {false['olmo']}\n"
        f"triggers at a natural excursion of the clean runs (>= {NATURAL}x): ours "
        f"{natural['ours']}, megatron-style {natural['megatron']}, olmo-style {natural['olmo']}"
        f"\n({time.perf_counter() - start:.0f} s)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "rows": rows,
                    "clean": clean,
                    "false": false,
                    "natural": natural,
                    "splits": splits,
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
