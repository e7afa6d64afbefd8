"""``ampguard report`` on a long run: a synthetic 1,000,000-step run folder, parse vs report.

Writes a run folder shaped like ``Telemetry``'s defaults (a record every step, per-layer norms
every 10 steps, range stats every 100 steps, 8 layers, a dynamic loss scale with growth every
2000 steps and an overflow now and then), then times, each phase in a fresh process so its peak
resident memory is its own:

- ``parse``: ``json.loads`` of every line, nothing kept (the floor any reader pays);
- ``load``: ``ampguard.runlog.load_run`` (parse + schema check + columns);
- ``report``: ``ampguard report RUN_DIR`` (load, rules, summary, figures, report.html).

Usage::

    python benchmarks/bench_report.py                   # 1,000,000 steps
    python benchmarks/bench_report.py --steps 100000 --keep /tmp/run100k
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS = [f"blocks.{i}.mlp" for i in range(7)] + ["head"]


def write_run(run_dir: Path, steps: int, seed: int = 0) -> int:
    """A synthetic run folder of ``steps`` steps; returns the size of events.jsonl in bytes."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": 1,
        "model": {
            "class": "Synthetic",
            "parameters": 10**6,
            "trainable_tensors": 16,
            "layers": len(LAYERS),
        },
        "layers": {"names": LAYERS, "numel": [1000] * len(LAYERS), "tensors": [2] * 8},
        "precision": "fp16",
        "requested_precision": "fp16",
        "scaler": {
            "init_scale": 65536.0,
            "min_scale": 1.0,
            "growth_interval": 2000,
            "dynamic": True,
        },
        "guard": {"accumulation_steps": 1},
        "resumes": [],
    }
    (run_dir / "meta.json").write_text(json.dumps(meta))
    scale, clean = 65536.0, 0
    with open(run_dir / "events.jsonl", "w", encoding="utf-8") as fh:
        for step in range(1, steps + 1):
            before = scale
            overflow = rng.random() < 0.001 or (clean >= 2000 and rng.random() < 0.3)
            if overflow:
                scale, clean = max(scale / 2, 1.0), 0
            else:
                clean += 1
                if clean % 2000 == 0:
                    scale *= 2
            loss = 2.0 * math.exp(-step / steps) + rng.random() * 0.05
            line = (
                f'{{"step":{step},"scale_before":{before},"scale":{scale},'
                f'"applied":{str(not overflow).lower()},"overflow":{str(overflow).lower()},'
                f'"collapse":false,"dropped":0,"loss":{loss:.7g},"precision":"fp16"'
            )
            if step % 10 == 0:
                norms = ",".join(f"{rng.random():.7g}" for _ in LAYERS)
                line += f',"grad_norm":{rng.random() * 3:.7g},"layers":{{"grad_norm":[{norms}]}}'
            if step % 100 == 0:

                def vals(lo: float, hi: float) -> str:
                    return ",".join(f"{rng.uniform(lo, hi):.7g}" for _ in LAYERS)

                line += (
                    f',"range":{{"zero_frac":[{vals(0, 0.1)}],"amax":[{vals(0.1, 10)}],'
                    f'"headroom_bits":[{vals(1, 10)}],"underflow":[{vals(0, 0.01)}],'
                    f'"safe_lo":[{vals(1, 64)}],"safe_hi":[{vals(1e3, 1e5)}],'
                    f'"window":[64.0,1000.0]}}'
                )
            fh.write(line + "}\n")
    return (run_dir / "events.jsonl").stat().st_size


_PHASES = {
    "parse": "import json\nfor line in open(sys.argv[1] + '/events.jsonl', 'rb'):\n"
    "    json.loads(line)\n",
    "load": "from ampguard import runlog\nrunlog.load_run(sys.argv[1])\n",
    "report": "from ampguard import cli\nimport contextlib, io\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    assert cli.main(['report', sys.argv[1]]) == 0\n",
}
_WRAP = (
    "import sys, time, resource, json\nt, c = time.perf_counter(), time.process_time()\n"
    "{body}"
    "print(json.dumps({{'seconds': time.perf_counter() - t, 'cpu': time.process_time() - c, "
    "'peak_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))\n"
)


def phase(name: str, run_dir: Path) -> dict[str, float]:
    """Wall and CPU seconds and peak resident MB of one phase, in a fresh Python process (CPU
    time is the steadier measure on a shared machine)."""
    code = _WRAP.format(body=_PHASES[name])
    out = subprocess.run(
        [sys.executable, "-c", code, str(run_dir)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (best kept)")
    parser.add_argument("--keep", default=None, help="write the run folder here and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.keep or Path(tmp) / "run")
        start = time.perf_counter()
        size = write_run(run_dir, args.steps)
        print(
            f"{args.steps:,} steps, events.jsonl {size / 2**20:.0f} MB "
            f"(written in {time.perf_counter() - start:.1f} s)"
        )
        rounds: dict[str, list[dict[str, float]]] = {n: [] for n in _PHASES}
        for _ in range(args.rounds):  # interleaved, so load on the machine hits every phase
            for name in _PHASES:
                rounds[name].append(phase(name, run_dir))
        best = {n: min(rs, key=lambda r: r["cpu"]) for n, rs in rounds.items()}
        base = best["parse"]
        for name, r in best.items():
            print(
                f"{name:7s} CPU {r['cpu']:6.2f} s ({r['cpu'] / base['cpu']:4.2f}x parse)  "
                f"wall {r['seconds']:6.2f} s  peak RSS {r['peak_mb']:5.0f} MB"
            )


if __name__ == "__main__":
    main()
