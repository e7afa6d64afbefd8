"""CLI and API edges of fp8 (one clear error each, never a traceback or a
verdict on nothing)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard import cli


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def two_layers(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 16))


# ---------------------------------------------------------------------- ampguard demo --out
@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_the_fp8_demo_with_an_unusable_out_is_one_line_and_exit_2(tmp_path, capsys, where):
    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / where
    assert cli.main(["demo", "--precision", "fp8", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ampguard demo: error: --out") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert (tmp_path / "file").read_text() == "not a folder"


# ---------------------------------------------------------------------- inspect --fp8
FACTORY = """
import torch
from torch import nn
import ampguard as ag

class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 16)

    def forward(self, x):
        raise RuntimeError("my forward is broken")

def raises():
    raise RuntimeError("my factory is broken")

def broken_forward():
    model = Broken()
    batch = (torch.randn(4, 32), torch.randn(4, 16))
    return ag.Experiment(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [batch],
        lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    )
"""


@pytest.mark.parametrize(
    ("name", "words", "fp8"),
    [
        ("raises", "my factory is broken", False),  # plain inspect: the reference behaviour
        ("raises", "my factory is broken", True),
        ("broken_forward", "my forward is broken", True),  # raised while the plan traced it
    ],
)
def test_inspect_shows_the_users_runtime_error_as_theirs(tmp_path, capsys, name, words, fp8):
    pytest.importorskip("torchao")
    path = tmp_path / "exp.py"
    path.write_text(textwrap.dedent(FACTORY))
    code = cli.main(["inspect", f"{path}:{name}", *(["--fp8"] if fp8 else [])])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "(in your code, not in ampguard; its traceback follows)" in err
    assert f"RuntimeError: {words}" in err
    frames = [line for line in err.splitlines() if line.lstrip().startswith('File "')]
    assert frames and all("/ampguard/" not in f for f in frames), frames
    assert str(path) in frames[-1]


# ---------------------------------------------------------------------- ag.fp8_plan's batch
@pytest.mark.parametrize(
    "batch",
    [
        (torch.randn(0, 32), torch.randn(0, 16)),
        torch.randn(0, 32),
    ],
    ids=["tuple", "tensor"],
)
def test_a_plan_on_a_batch_of_zero_rows_is_a_value_error_naming_batch(batch):
    def loss(m, b):
        x = b[0] if isinstance(b, tuple) else b
        return m(x).float().pow(2).mean()

    with pytest.raises(ValueError, match=r"^batch( \(tensor 0\))? has 0 rows"):
        ag.fp8_plan(two_layers(), loss, batch)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_plan_on_a_non_finite_batch_is_an_error_not_a_verdict(bad):
    x, y = torch.randn(8, 32), torch.randn(8, 16)
    x[3, 5] = bad
    with pytest.raises(ValueError, match="the batch is not finite: batch \\(tensor 0\\)"):
        ag.fp8_plan(two_layers(), mse, (x, y))


def test_a_finite_batch_still_gets_a_verdict():
    plan = ag.fp8_plan(two_layers(), mse, (torch.randn(8, 32), torch.randn(8, 16)))
    assert set(plan.layers) == {"0", "2"} and plan.layers["0"]["shape"] == (32, 32)


# ---------------------------------------------------------------------- a plan for another model
def test_a_plan_made_for_another_model_with_the_same_names_is_refused_and_nothing_changes():
    pytest.importorskip("torchao")
    plan = ag.fp8_plan(two_layers(32), mse, (torch.randn(8, 32), torch.randn(8, 16)))
    other = two_layers(64)  # the same names ("0", "2"), other shapes
    types = [type(m) for m in other.modules()]
    with pytest.raises(ValueError, match="fp8_plan was made for another model: its layers' shapes"):
        ag.Guard(other, torch.optim.SGD(other.parameters(), lr=0.1), precision="fp8", fp8_plan=plan)
    assert [type(m) for m in other.modules()] == types  # no layer was converted


def test_the_error_names_the_layer_and_both_shapes():
    pytest.importorskip("torchao")
    plan = ag.fp8_plan(two_layers(32), mse, (torch.randn(8, 32), torch.randn(8, 16)))
    other = two_layers(64)
    with pytest.raises(ValueError, match=r"'0' \(32x32 in the plan, 32x64 here\)"):
        ag.Guard(other, torch.optim.SGD(other.parameters(), lr=0.1), precision="fp8", fp8_plan=plan)
