"""ampguard.compare: a planted model per verdict, per-variant results, save(), CLI, loader."""

from __future__ import annotations

import base64
import json
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard as ag
from ampguard.cli import main
from ampguard.cli._loader import load_factory
from ampguard.experiments import VARIANTS

STEPS = 24


def data(n=4, batch=8, d=16, out=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, d, generator=g), torch.randn(batch, out, generator=g)) for _ in range(n)
    ]


def mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def healthy():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return ag.Experiment(model, torch.optim.SGD(model.parameters(), lr=0.05), data(), mse)


def exploding():
    """lr=50 diverges to NaN in fp32 within a few steps."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return ag.Experiment(model, torch.optim.SGD(model.parameters(), lr=50.0), data(), mse)


class Wide(nn.Module):
    """fc's weights and outputs pass 65504: finite in fp32 and bf16, inf in fp16."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.fc.weight.mul_(3e5)

    def forward(self, x):
        return self.head(self.norm(self.fc(x)))


def out_of_range():
    model = Wide()
    return ag.Experiment(model, torch.optim.SGD(model.parameters(), lr=0.05), data(), mse)


def l1_loss(model, batch):
    # d(loss)/d(output) = +-700 per element whatever the weights: x scale overflows fp16 from
    # scale 128 up (700 * 128 > 65504) and fits at 64.
    return 22400.0 * (model(batch[0]) - batch[1]).abs().mean()


def probing():
    model = nn.Linear(16, 4, bias=False)
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.rand(8, 16, generator=g) * 0.1, torch.randn(8, 4, generator=g)) for _ in range(4)
    ]
    return ag.Experiment(model, torch.optim.SGD(model.parameters(), lr=1e-6), batches, l1_loss)


PROBING_SCALER = ag.ScalerConfig(init_scale=1024.0, growth_interval=2)


@pytest.fixture(scope="module")
def healthy_cmp():
    return ag.compare(healthy, steps=STEPS, progress=False)


@pytest.fixture(scope="module")
def range_cmp():
    return ag.compare(out_of_range, steps=STEPS, progress=False)


# ------------------------------------------------------------------------ verdicts


def test_healthy_model_is_amp_ok(healthy_cmp):
    assert healthy_cmp.verdict == "amp_ok"
    assert all(r.trained for r in healthy_cmp.variants.values())
    assert healthy_cmp.finding().code == "AG333"


def test_probing_overflow_is_a_dynamic_scale_conflict():
    cmp = ag.compare(probing, steps=30, progress=False, scaler=PROBING_SCALER)
    assert cmp.verdict == "dynamic_scale_conflict"
    assert cmp.variants["fp16_dynamic"].skipped > 0.25 * 30
    assert cmp.variants["fp16_fixed"].skipped == 0
    assert "max_scale=64" in cmp.fix
    assert cmp.finding().code == "AG334"


def test_activations_beyond_fp16_max_are_fp16_range(range_cmp):
    assert range_cmp.verdict == "fp16_range"
    assert range_cmp.variants["bf16"].trained and not range_cmp.variants["fp16_fixed"].trained
    assert range_cmp.finding().severity == "error"


def test_fp16_range_names_the_first_failing_batch(range_cmp):
    assert range_cmp.failing_batch == 0
    assert "batch #0" in range_cmp.explanation


def test_fp16_range_runs_locate_on_the_failing_batch(range_cmp):
    pytest.importorskip("ampguard.forensics")
    assert range_cmp.locate_error is None
    assert range_cmp.diagnosis.kind == "fp16_overflow"
    assert range_cmp.diagnosis.module == "fc"
    assert "keep_fp32=['fc']" in range_cmp.fix


def test_model_that_diverges_in_fp32_is_a_model_problem():
    cmp = ag.compare(exploding, steps=STEPS, progress=False)
    assert cmp.verdict == "model_problem"
    assert not cmp.variants["fp32"].trained
    assert "not an AMP problem" in cmp.explanation


# ------------------------------------------------------------------------ per-variant results


def test_every_variant_starts_from_identical_weights():
    seen = []

    def factory():
        exp = healthy()
        seen.append(torch.cat([p.detach().flatten() for p in exp.model.parameters()]))
        return exp

    ag.compare(factory, steps=2, progress=False)
    assert len(seen) == len(VARIANTS)
    assert all(torch.equal(seen[0], w) for w in seen[1:])


def test_fp32_baseline_is_its_own_reference(healthy_cmp):
    base = healthy_cmp.variants["fp32"]
    assert base.max_rel_dev == 0.0 and base.throughput_ratio == 1.0
    assert len(base.losses) == STEPS


def test_fp16_variants_report_their_final_scale(healthy_cmp):
    assert healthy_cmp.variants["fp16_fixed"].final_scale == 64.0
    assert healthy_cmp.variants["fp16_dynamic"].final_scale == 2.0**16
    assert healthy_cmp.variants["bf16"].final_scale is None


def test_deviation_from_fp32_is_small_when_healthy_and_inf_when_nonfinite(healthy_cmp, range_cmp):
    assert 0 < healthy_cmp.variants["fp16_dynamic"].max_rel_dev < 1e-2
    assert math.isinf(range_cmp.variants["fp16_noscaler"].max_rel_dev)


def test_throughput_ratio_is_measured_for_every_variant(healthy_cmp):
    ratios = [r.throughput_ratio for r in healthy_cmp.variants.values()]
    assert all(math.isfinite(x) and x > 0 for x in ratios)


def test_skipped_steps_are_counted_and_located(range_cmp):
    fixed = range_cmp.variants["fp16_fixed"]
    assert fixed.skipped == STEPS and fixed.skipped_at == list(range(1, STEPS + 1))


def test_variant_subset_always_includes_fp32():
    cmp = ag.compare(healthy, steps=4, variants=["bf16"], progress=False)
    assert list(cmp.variants) == ["fp32", "bf16"]


def test_list_batches_are_cycled():
    cmp = ag.compare(healthy, steps=10, variants=["bf16"], progress=False)
    assert len(cmp.variants["bf16"].losses) == 10  # 4 batches, cycled


def test_one_shot_iterator_ends_the_run():
    def factory():
        exp = healthy()
        exp.batches = iter(data(n=3))
        return exp

    cmp = ag.compare(factory, steps=10, variants=["bf16"], progress=False)
    assert [len(r.losses) for r in cmp.variants.values()] == [3, 3]


def test_amp_variant_that_raises_is_recorded_as_failed():
    def loss_fn(model, batch):
        if torch.is_autocast_enabled("cpu"):
            raise RuntimeError("expected scalar type Half but found Float")
        return mse(model, batch)

    def factory():
        exp = healthy()
        exp.loss_fn = loss_fn
        return exp

    cmp = ag.compare(factory, steps=4, variants=["bf16"], progress=False)
    assert "expected scalar type Half" in cmp.variants["bf16"].error
    assert not cmp.variants["bf16"].trained


def test_fp32_baseline_errors_propagate():
    def factory():
        exp = healthy()
        exp.loss_fn = lambda m, b: m(b[0][:, :3])  # a shape bug in the user's code
        return exp

    with pytest.raises(RuntimeError):
        ag.compare(factory, steps=2, progress=False)


def test_progress_bar_is_shown(capsys):
    ag.compare(healthy, steps=3, variants=["bf16"], progress=True)
    assert "step" in capsys.readouterr().err


# ------------------------------------------------------------------------ save()


def test_save_writes_strict_json(range_cmp, tmp_path):
    range_cmp.save(tmp_path)
    data = json.loads(
        (tmp_path / "comparison.json").read_text(),
        parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"),
    )
    assert data["verdict"] == "fp16_range" and data["finding"]["code"] == "AG335"
    assert data["variants"]["fp16_noscaler"]["losses"][0] is None  # NaN -> null


def test_save_embeds_plots_as_png(healthy_cmp, tmp_path):
    page = healthy_cmp.save(tmp_path)
    text = page.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(images) == 2
    from matplotlib.image import imread

    for b64 in images:
        png = tmp_path / "plot.png"
        png.write_bytes(base64.b64decode(b64))
        assert imread(png).shape[0] > 100  # decodes as a real image
    assert "amp_ok" in text and "<script" not in text


def test_summary_lists_every_variant_and_the_verdict(healthy_cmp):
    text = healthy_cmp.summary()
    assert all(name in text for name in healthy_cmp.variants)
    assert "verdict: amp_ok (AG333)" in text


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"steps": 0}, ValueError, "steps must be an integer >= 1"),
        ({"variants": ["fp4"]}, ValueError, "variants must be names from"),
        ({"variants": ["fp32"]}, ValueError, "at least one variant besides"),
        ({"variants": "bf16"}, TypeError, "sequence of variant names"),
        ({"scaler": {"init_scale": 64}}, TypeError, "scaler must be an ampguard.ScalerConfig"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        ag.compare(healthy, progress=False, **kwargs)


def test_factory_must_return_an_experiment():
    with pytest.raises(TypeError, match="factory\\(\\) must return an ampguard.Experiment"):
        ag.compare(lambda: nn.Linear(2, 2), steps=2, progress=False)


def test_experiment_checks_its_fields():
    with pytest.raises(TypeError, match="Experiment.optimizer"):
        ag.Experiment(nn.Linear(2, 2), "sgd", [], mse)


# ------------------------------------------------------------------------ loader and CLI

FACTORY_FILE = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn
    import ampguard as ag

    def make():
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))]
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        return ag.Experiment(model, torch.optim.SGD(model.parameters(), lr=0.05), batches,
                             lambda m, b: F.mse_loss(m(b[0]), b[1]))

    def half_model():
        return nn.Sequential(nn.Linear(4, 4)).half()

    def half_experiment():
        model = half_model()
        batch = torch.randn(2, 4).half()
        return ag.Experiment(model, torch.optim.Adam(model.parameters()), [batch],
                             lambda m, b: m(b).float().pow(2).mean())

    NOT_CALLABLE = 3
""")


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "cmp_factories.py"
    path.write_text(FACTORY_FILE)
    return path


def test_cli_compare_writes_the_report(factory_file, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "compare",
            f"{factory_file}:make",
            "--steps",
            "4",
            "--out",
            str(out),
            "--variants",
            "bf16",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert (out / "comparison.html").is_file() and (out / "comparison.json").is_file()
    assert "verdict: amp_ok" in capsys.readouterr().out


def test_cli_inspect_exits_0_on_warnings(factory_file, capsys):
    assert main(["inspect", f"{factory_file}:half_model"]) == 0
    assert "AG325 [warning]" in capsys.readouterr().out


def test_cli_inspect_exits_1_on_an_error_finding(factory_file, capsys):
    assert main(["inspect", f"{factory_file}:half_experiment"]) == 1
    assert "AG323 [error]" in capsys.readouterr().out


def test_cli_inspect_probes_an_experiments_first_batch(factory_file, capsys):
    assert main(["inspect", f"{factory_file}:make", "--json"]) == 0
    assert [f["code"] for f in json.loads(capsys.readouterr().out)] == ["AG331"]


def test_cli_reports_a_bad_reference_with_exit_2(capsys):
    assert main(["inspect", "no_such_module_xyz:make"]) == 2
    assert "cannot import module 'no_such_module_xyz'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "ref, error, match",
    [
        ("no_colon", ValueError, "expected 'pkg.module:factory'"),
        ("json:", ValueError, "expected 'pkg.module:factory'"),
        ("json:nope", ValueError, "'json' has no attribute 'nope'"),
        ("/no/such/file.py:make", ValueError, "no such file"),
    ],
)
def test_loader_errors_say_what_is_wrong(ref, error, match):
    with pytest.raises(error, match=match):
        load_factory(ref)


def test_loader_rejects_a_non_callable(factory_file):
    with pytest.raises(TypeError, match="not a callable factory"):
        load_factory(f"{factory_file}:NOT_CALLABLE")


def test_loader_reports_an_import_that_raises(tmp_path):
    path = Path(tmp_path / "broken_factory.py")
    path.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ValueError, match="raised RuntimeError: boom at import"):
        load_factory(f"{path}:make")


def test_loader_imports_dotted_module_paths():
    assert load_factory("ampguard.experiments:compare") is ag.compare


def test_importing_the_module_keeps_ag_compare_a_function():
    import ampguard.experiments  # noqa: F401

    assert ag.compare.__name__ == "compare" and callable(ag.compare)


def test_fixed_scale_that_trains_while_bf16_fails_without_a_dynamic_run_is_amp_ok():
    # Without an fp16_dynamic run there is no dynamic-scale conflict to explain: the fp16
    # variant that trains makes the verdict amp_ok, and the failing bf16 run is named.
    def loss_fn(model, batch):
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
            raise RuntimeError("bf16 is not supported by this op")
        return mse(model, batch)

    def factory():
        exp = healthy()
        exp.loss_fn = loss_fn
        return exp

    cmp = ag.compare(factory, steps=4, variants=["fp16_fixed", "bf16"], progress=False)
    assert cmp.variants["fp16_fixed"].trained and not cmp.variants["bf16"].trained
    assert cmp.verdict == "amp_ok"
    assert cmp.explanation.startswith("fp16_fixed trains like fp32")
    assert "bf16 fails" in cmp.explanation
    assert "verdict: amp_ok" in cmp.summary()
