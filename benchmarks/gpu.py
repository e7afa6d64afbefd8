"""One-command GPU benchmark: ampguard on a GPT-2-small-like model in fp16 and bf16.

Run: ``python benchmarks/gpu.py [--json gpu.json]`` on a machine with one CUDA GPU (about 2-4
minutes), or ``python benchmarks/gpu.py --dry-run`` anywhere (a tiny model on the CPU, seconds;
the test suite runs it so the script cannot rot).

The model is a hand-written GPT-2-small-shaped decoder built from its config (12 blocks, width
768, 12 heads, vocabulary 50257; pre-LayerNorm, GELU MLP, ``scaled_dot_product_attention``
with a causal mask, tied embeddings): no download, no ``transformers`` needed. Every loop trains
its own copy from the same seed on the same batch; rounds are interleaved (each loop once per
round, the device synchronised around each), and each loop's median step time is divided by the
bare AMP loop's of the same precision. Loops, per precision:

* ``bare``: ``torch.autocast`` (+ ``torch.amp.GradScaler`` for fp16) and ``torch.optim.AdamW``;
* ``guard``: ``ag.Guard``; ``guard + telemetry``: ``telemetry=run_dir`` (defaults);
* ``guard + layer stats``: ``Telemetry(layer_every=1)``;
* ``armed forensics``: ``Guard(forensics=True)`` kept armed (every op traced);
* ``bare, fused AdamW`` and ``guard, fused AdamW``: ``AdamW(fused=True)``;

plus ``fp32`` (no autocast) once, for the fp16/bf16 speed-up. Host syncs per step are counted
with ``ag.SyncCounter`` and, on CUDA, with ``torch.cuda.set_sync_debug_mode("warn")`` (the
number of sync warnings per step). Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard as ag
from ampguard.guard._forensics import ARM_STEPS


@dataclass
class Config:
    """Model and batch shape (defaults: GPT-2 small, batch 8 x 512 tokens)."""

    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    seq: int = 512
    batch: int = 8


TINY = Config(layers=2, width=32, heads=2, vocab=64, seq=16, batch=2)


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-shaped decoder (learned positions, pre-LN blocks, tied LM head)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_model(cfg: Config, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return GPT(cfg).to(device)


def adamw(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)


def bare_loop(
    cfg: Config, device: torch.device, dtype: torch.dtype | None, batch: Any, fused: bool = False
) -> Callable[[], None]:
    """Plain torch: autocast to ``dtype`` (None: fp32), GradScaler for fp16, AdamW."""
    model = make_model(cfg, device)
    opt = adamw(model, fused)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    x, y = batch

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = lm_loss(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def guard_loop(
    cfg: Config,
    device: torch.device,
    precision: str,
    batch: Any,
    *,
    fused: bool = False,
    telemetry: Any = None,
    armed: bool = False,
) -> Callable[[], None]:
    """The same step through ``ag.Guard`` (``armed``: forensics kept armed, every op traced)."""
    model = make_model(cfg, device)
    guard = ag.Guard(
        model, adamw(model, fused), precision=precision, telemetry=telemetry, forensics=armed
    )
    x, y = batch

    def step() -> None:
        if armed:
            guard._state.forensics.arm(ARM_STEPS)  # the Guard's own forensics, kept armed
        with guard.autocast():
            loss = lm_loss(model(x), y)
        guard.backward(loss)
        guard.step()

    return step


def loops_for(
    cfg: Config, device: torch.device, precision: str, batch: Any, root: Path, fused_ok: bool
) -> dict[str, Callable[[], None]]:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    out = {
        "bare": bare_loop(cfg, device, dtype, batch),
        "guard": guard_loop(cfg, device, precision, batch),
        "guard + telemetry": guard_loop(
            cfg, device, precision, batch, telemetry=ag.Telemetry(root / f"{precision}-tel")
        ),
        "guard + layer stats": guard_loop(
            cfg,
            device,
            precision,
            batch,
            telemetry=ag.Telemetry(root / f"{precision}-layers", layer_every=1),
        ),
        "armed forensics": guard_loop(cfg, device, precision, batch, armed=True),
    }
    if fused_ok:
        out["bare, fused AdamW"] = bare_loop(cfg, device, dtype, batch, fused=True)
        out["guard, fused AdamW"] = guard_loop(cfg, device, precision, batch, fused=True)
    return out


def fused_supported(device: torch.device) -> bool:
    try:
        p = torch.nn.Parameter(torch.zeros(2, device=device))
        p.grad = torch.ones(2, device=device)
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError):
        return False
    return True


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_rounds(
    loops: dict[str, Callable[[], None]], device: torch.device, rounds: int, steps: int, warmup: int
) -> dict[str, float]:
    """Median seconds per step of each loop over interleaved rounds."""
    for step in loops.values():
        for _ in range(warmup):
            step()
    sync(device)
    per: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, step in loops.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync(device)
            per[name].append((time.perf_counter() - t0) / steps)
    return {name: statistics.median(v) for name, v in per.items()}


def count_syncs(step: Callable[[], None], device: torch.device, steps: int) -> dict[str, float]:
    """Host syncs per step: ``ag.SyncCounter``, and CUDA's sync debug mode warnings."""
    with ag.SyncCounter() as counter:
        for _ in range(steps):
            step()
    out = {"sync_counter": counter.count / steps}
    if device.type == "cuda":
        sync(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out["cuda_sync_warnings"] = sum("synchroniz" in str(w.message) for w in caught) / steps
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (or --dry-run for a CPU check)")
    device = torch.device("cpu" if dry else "cuda")
    cfg = TINY if dry else Config(batch=args.batch, seq=args.seq)
    rounds, steps, warmup = (1, 1, 1) if dry else (args.rounds, args.steps, 3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    root = Path(tempfile.mkdtemp(prefix="ampguard-gpu-bench-"))
    fused_ok = fused_supported(device)
    rows: list[dict[str, Any]] = []
    fp32 = time_rounds(
        {"fp32": bare_loop(cfg, device, None, batch)}, device, rounds, steps, warmup
    )["fp32"]
    rows.append(
        {"precision": "fp32", "loop": "bare", "ms": fp32 * 1e3, "ratio": 1.0, "vs_fp32": 1.0}
    )
    for precision in ("fp16", "bf16"):
        loops = loops_for(cfg, device, precision, batch, root / precision, fused_ok)
        med = time_rounds(loops, device, rounds, steps, warmup)
        for name, step in loops.items():
            rows.append(
                {
                    "precision": precision,
                    "loop": name,
                    "ms": med[name] * 1e3,
                    "ratio": med[name] / med["bare"],
                    "vs_fp32": med[name] / fp32,
                    **count_syncs(step, device, 1 if dry else 5),
                }
            )
        del loops
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "ampguard": ag.__version__,
        "python": platform.python_version(),
        "config": asdict(cfg),
        "rounds": rounds,
        "steps_per_round": steps,
        "fused_adamw": fused_ok,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"{result['device']}, torch {result['torch']}, ampguard {result['ampguard']}; "
        f"{cfg['layers']} blocks x width {cfg['width']}, batch {cfg['batch']} x "
        f"{cfg['seq']} tokens; median of {result['rounds']} interleaved rounds x "
        f"{result['steps_per_round']} steps",
        f"{'precision':9s} {'loop':22s} {'ms/step':>9s} {'x bare':>7s} {'x fp32':>7s} "
        f"{'syncs/step':>10s} {'cuda syncs':>10s}",
    ]
    for r in result["rows"]:
        cuda = r.get("cuda_sync_warnings")
        lines.append(
            f"{r['precision']:9s} {r['loop']:22s} {r['ms']:9.2f} {r['ratio']:7.3f} "
            f"{r['vs_fp32']:7.3f} {r.get('sync_counter', math.nan):10.1f} "
            f"{'' if cuda is None else f'{cuda:.1f}':>10s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny model on the CPU, one round: checks that the script works",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "batch", "seq"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    result = run(args)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
