"""benchmarks/spike_zoo.py: a planted spike is physically there (the detector sees it at the
planted window, the peers' rules are scored on the same losses) and the autopsy names its
mechanism and layer with a verified counterfactual; the score counts what it says."""

import pytest
from _bench import bench_module


@pytest.fixture(scope="module")
def zoo():
    with bench_module("spike_zoo") as module:
        yield module


@pytest.mark.slow
def test_a_planted_attention_spike_is_found_named_and_verified(zoo):
    row = zoo.run("attention_logit_growth", 0, "tiny-32x1", zoo.T)
    assert zoo.T in row["ours"]
    assert row["diagnosis"] == "attention_logit_growth" and row["verified"]
    assert row["layer"] in row["expected_layers"]
    s = zoo.score([row])
    assert (s["detected"], s["mechanism"], s["layer"], s["verified"]) == (1, 1, 1, 1)


@pytest.mark.slow  # imports transformers
def test_every_plant_names_layers_of_both_model_families(zoo):
    for kind in ("tiny-32x2", "gpt2"):
        model = zoo.build(kind, 0)
        modules = dict(model.named_modules())
        for mechanism, names in zoo.layers(kind).items():
            if kind == "gpt2" and mechanism not in zoo.GPT2_CASES:
                continue
            assert names and all(n in modules for n in names), (kind, mechanism)
