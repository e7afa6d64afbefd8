"""Checkpoint cost: ``ag.save_checkpoint`` / ``ag.load_checkpoint`` against plain torch.

Run: ``python benchmarks/bench_checkpoint.py [--mb 128] [--rounds 5]``. One MLP of about ``--mb``
MB of fp32 parameters, trained one AdamW step (so the optimizer state doubles it: the file is
about 3x ``--mb``). Rounds are interleaved (torch, ampguard, torch, ...) and medians compared:

- save: ``torch.save({"model", "optimizer"}, path)`` vs ``ag.save_checkpoint`` (temp file, fsync,
  atomic rename, CRC-32s on).
- load: ``torch.load(weights_only=True)`` + ``model.load_state_dict`` + ``opt.load_state_dict`` vs
  ``ag.load_checkpoint`` (CRC-32 of every zip member, every field checked, then the same copies).
- the integrity check alone (``verify_zip``) in seconds per GB, and the field checks alone.

The files live in a temporary folder (the page cache is warm after the first round, as when a
run resumes from a file it just wrote or read).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import ampguard as ag
from ampguard.checkpoint import _validate as _ckpt_validate
from ampguard.checkpoint._files import verify_zip


def build(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 2048
    depth = max(1, round(mb * 2**20 / 4 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=128, help="parameter MB (file is about 3x)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, opt = build(args.mb)
    with tempfile.TemporaryDirectory() as tmp:
        plain, ours = Path(tmp) / "torch.pt", Path(tmp) / "ampguard.pt"
        loops: dict[str, Callable[[], object]] = {
            "save torch": lambda: torch.save(
                {"model": model.state_dict(), "optimizer": opt.state_dict()}, plain
            ),
            "save ampguard": lambda: ag.save_checkpoint(
                ours, model=model, optimizer=opt, rng=False
            ),
            "load torch": lambda: load_plain(plain, model, opt),
            "load ampguard": lambda: ag.load_checkpoint(
                ours, model=model, optimizer=opt, rng=False
            ),
            "crc-32 only": lambda: verify_zip(ours),
            "field checks only": lambda: checks_only(ours, model, opt),
        }
        for fn in loops.values():  # warm-up: files exist, page cache warm
            fn()
        times: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(args.rounds):
            for name, fn in loops.items():
                times[name].append(timed(fn))
        gb = ours.stat().st_size / 1e9
    med = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"checkpoint {gb:.3f} GB (torch {args.mb} MB of parameters + AdamW state), "
        f"{args.rounds} interleaved rounds, medians, torch {torch.__version__}"
    )
    print(
        f"  save: torch.save {med['save torch']:.3f} s, ag.save_checkpoint "
        f"{med['save ampguard']:.3f} s = {med['save ampguard'] / med['save torch']:.2f}x"
    )
    print(
        f"  load: torch.load + load_state_dict {med['load torch']:.3f} s, ag.load_checkpoint "
        f"{med['load ampguard']:.3f} s = {med['load ampguard'] / med['load torch']:.2f}x"
    )
    print(
        f"  of which CRC-32 of every member {med['crc-32 only']:.3f} s = "
        f"{med['crc-32 only'] / gb:.3f} s/GB ({med['crc-32 only'] / med['load torch']:.2f}x "
        f"of the torch load); field checks {med['field checks only'] * 1e3:.1f} ms"
    )
    return 0


def load_plain(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    data = torch.load(path, weights_only=True)
    model.load_state_dict(data["model"])
    opt.load_state_dict(data["optimizer"])


_CACHE: dict[str, object] = {}


def checks_only(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    if "data" not in _CACHE:
        _CACHE["data"] = torch.load(path, weights_only=True)
    data = _CACHE["data"]
    assert isinstance(data, dict)
    _ckpt_validate.check_model(model, data["model"], path)
    _ckpt_validate.check_optimizers(opt, data["optimizer"], path)


if __name__ == "__main__":
    sys.exit(main())
