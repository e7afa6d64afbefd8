"""benchmarks/gpu.py: its CPU dry run works (so the GPU benchmark cannot rot) and, on a CUDA
machine, a short real run adds no host syncs over the Guard's own."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
LOOPS = {"bare", "guard", "guard + telemetry", "guard + layer stats", "armed forensics"}


def _gpu_bench():
    spec = importlib.util.spec_from_file_location("ampguard_gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> dict[tuple[str, str], dict]:
    result = json.loads(path.read_text())
    return {(r["precision"], r["loop"]): r for r in result["rows"]}


def test_dry_run_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert _gpu_bench().main(["--dry-run", "--json", str(out)]) == 0
    rows = _rows(out)
    assert ("fp32", "bare") in rows
    for precision in ("fp16", "bf16"):
        assert {loop for p, loop in rows if p == precision} >= LOOPS
        assert rows[(precision, "bare")]["ratio"] == 1.0
        # telemetry and per-layer statistics add no host sync to the Guard's step
        guard = rows[(precision, "guard")]["sync_counter"]
        assert rows[(precision, "guard + telemetry")]["sync_counter"] == guard
        assert rows[(precision, "guard + layer stats")]["sync_counter"] == guard
    table = capsys.readouterr().out
    assert "armed forensics" in table and "x fp32" in table


def test_bad_argument_is_one_clear_error(capsys):
    with pytest.raises(SystemExit):
        _gpu_bench().main(["--dry-run", "--rounds", "0"])
    assert "--rounds must be >= 1" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_short_cuda_run_adds_no_syncs_to_the_guard(tmp_path):
    out = tmp_path / "gpu.json"
    assert (
        _gpu_bench().main(
            ["--rounds", "1", "--steps", "2", "--seq", "128", "--batch", "2", "--json", str(out)]
        )
        == 0
    )
    rows = _rows(out)
    for precision in ("fp16", "bf16"):
        guard = rows[(precision, "guard")]
        for loop in ("guard + telemetry", "guard + layer stats"):
            assert rows[(precision, loop)]["cuda_sync_warnings"] <= guard["cuda_sync_warnings"]
