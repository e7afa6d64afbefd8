"""benchmarks/silent_zoo.py: the zoo's discovery and its case interface, and one case run end to
end (locate, a Guard run, the advisor) against what it expects."""

import pytest
from _bench import bench_module


@pytest.fixture(scope="module")
def runner():
    with bench_module("silent_zoo") as module:
        yield module


def test_discovery_finds_every_case_with_its_interface(runner):
    cases = list(runner.zoo.discover())
    names = [m.NAME for m in cases]
    assert len(names) == len(set(names))
    assert {"absorbed_norm", "no_scaler_underflow", "attention_qk", "sigmoid_bce"} <= set(names)
    for m in cases:
        assert m.EXPECT and set(m.EXPECT) <= runner.zoo.EXPECT_KEYS
        assert isinstance(m.DESCRIPTION, str) and m.DESCRIPTION


def test_a_broken_case_fails_loudly(runner, tmp_path):
    import types

    broken = types.ModuleType("zoo.broken")
    broken.NAME, broken.build = "broken", lambda: None
    with pytest.raises(TypeError, match="has no DESCRIPTION"):
        runner.zoo._check(broken)
    broken.DESCRIPTION, broken.EXPECT = "x", {"guards": "AG170"}
    with pytest.raises(ValueError, match="EXPECT keys"):
        runner.zoo._check(broken)


def test_one_case_runs_end_to_end(runner):
    result = runner.run_case(runner.zoo.load("absorbed_norm"))
    assert result["ok"], result["misses"]
    assert result["locate"]["kind"] == "fp16_overflow_absorbed"
    assert any(f["code"] == "AG170" and f["module"] == "norm" for f in result["guard"])


def test_unknown_case_is_refused(runner):
    with pytest.raises(SystemExit):
        runner.main(["--case", "no_such_case"])
