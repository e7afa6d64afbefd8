"""Render the demo's report.html in headless Chromium into ``docs/img/report.png``.

    python tools/screenshot_report.py                 # the demo run, 1200 px wide
    python tools/screenshot_report.py --out x.png --width 1000 --height 1500

Runs ``ampguard demo`` (this checkout's code) into a temporary folder, opens its self-contained
report with Debian's ``chromium`` (``apt-get install -y chromium``) headless and offline, and
writes the top ``--height`` pixels of the page as a palette PNG (Pillow, which matplotlib brings),
so the screenshot in the README and the docs comes from the code, not from a hand.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=5000",
]


def _demo(run_dir: Path) -> Path:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "ampguard", "demo", "--out", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    page = run_dir / "report.html"
    if proc.returncode != 0 or not page.exists():
        sys.exit(
            f"screenshot_report: the demo wrote no report (status {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    return page


def _shoot(page: Path, png: Path, width: int, height: int, work: Path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("screenshot_report: no chromium on PATH (apt-get install -y chromium)")
    raw = work / "raw.png"
    cmd = [
        chromium,
        *FLAGS,
        f"--user-data-dir={work / 'profile'}",
        f"--window-size={width},{height}",
        f"--screenshot={raw}",
        page.as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if not raw.exists():
        sys.exit(
            f"screenshot_report: chromium wrote no screenshot (status {proc.returncode}):\n"
            f"{proc.stderr[-2000:]}"
        )
    from PIL import Image

    with Image.open(raw) as img:
        small = img.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
        png.parent.mkdir(parents=True, exist_ok=True)
        tmp = png.with_name(f".{png.name}.tmp")
        small.save(tmp, format="PNG", optimize=True)
        os.replace(tmp, png)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "report.png")
    ap.add_argument("--width", type=int, default=1200)
    ap.add_argument("--height", type=int, default=1500)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ampguard-shot-") as tmp:
        work = Path(tmp)
        page = _demo(work / "run")
        _shoot(page, args.out, args.width, args.height, work)
    print(f"screenshot_report: wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
