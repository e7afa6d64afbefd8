"""Non-finite gradients under FSDP2 (2 real gloo ranks): a non-finite bf16 gradient shard on
one rank makes every rank skip the window; the parameters stay finite and identical across ranks."""

import _distributed_scenarios as S
import pytest


@pytest.mark.slow  # multi-process (gloo)
@pytest.mark.timeout(150)
def test_fsdp2_bf16_nonfinite_shard_on_one_rank_is_skipped_by_every_rank(tmp_path):
    results = S.run_group(2, ["fsdp2_bf16_nonfinite"], timeout=120, tmp=str(tmp_path))
    per_rank = results["fsdp2_bf16_nonfinite"]
    assert sorted(per_rank) == [0, 1], per_rank
    values = []
    for rank in (0, 1):
        status, value = per_rank[rank]
        assert status == "ok", value
        values.append(value)
    for v in values:
        assert v["applied"] == [True, False, True, True]
        assert v["finite"] and v["nonfinite"] == 1
    assert values[0]["params"] == values[1]["params"]  # bitwise
