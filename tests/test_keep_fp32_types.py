"""keep_fp32 takes module classes as well as name globs, and AG320's advice uses them, so it
covers every BatchNorm of a resnet-like model instead of listing 8 of 20."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampguard as ag
from ampguard.forensics.islands import keep_fp32, match_modules


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.down is None else self.down(x)))


def resnet_like() -> nn.Module:
    """resnet18's layout at width 4-16: a stem BatchNorm, 8 blocks of 2, 3 downsample ones."""
    torch.manual_seed(0)
    widths = [(4, 4, 1), (4, 4, 1), (4, 8, 2), (8, 8, 1), (8, 12, 2), (12, 12, 1), (12, 16, 2)]
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, 1, 1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        *[Block(a, b, s) for a, b, s in [*widths[:1], *widths]],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def _bns(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]


def test_the_model_has_twenty_batchnorms():
    assert len(_bns(resnet_like())) == 20


def test_a_module_class_matches_every_instance_and_mixes_with_globs():
    model = resnet_like()
    assert match_modules(model, [nn.BatchNorm2d]) == _bns(model)
    assert match_modules(model, nn.BatchNorm2d) == _bns(model)
    mixed = match_modules(model, ["11", nn.BatchNorm2d])  # the Linear head by name
    assert mixed == [*_bns(model), "11"]


@pytest.mark.parametrize(
    ("value", "error", "text"),
    [
        ([3], TypeError, "keep_fp32 must hold module-name patterns (str) or torch.nn.Module"),
        ([torch.Tensor], TypeError, "torch.nn.Module subclasses"),
        (3.0, TypeError, "keep_fp32 must be a list of module-name patterns (str) or module"),
        ([nn.LSTM], ValueError, "keep_fp32 class LSTM matches no module of Sequential"),
    ],
)
def test_bad_entries_get_one_clear_error(value, error, text):
    model = resnet_like()
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        ag.Guard(
            model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", keep_fp32=value
        )


def test_ag320_advice_covers_every_batchnorm_and_works_as_written():
    model = resnet_like()
    (f,) = [f for f in ag.inspect_model(model) if f.code == "AG320"]
    assert "keep_fp32=[torch.nn.BatchNorm2d]" in f.fix and f.evidence["count"] == 20
    advice = f.fix.split("keep_fp32=")[1].split(")")[0]
    kept = eval(advice, {"torch": torch})  # the advice is code that runs as written
    guard = ag.Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", keep_fp32=kept
    )
    seen: dict[str, torch.dtype] = {}
    hooks = [  # after the Guard's own pre-hooks: they see what the BatchNorm computes on
        m.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(n, args[0].dtype))
        for n, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
    with guard.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    guard.backward(loss)
    guard.step()
    for h in hooks:
        h.remove()
    assert set(seen) == set(_bns(model)) and set(seen.values()) == {torch.float32}


def test_a_class_keep_fp32_resumes_from_the_saved_names(tmp_path):
    model = resnet_like()
    guard = ag.Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision="fp16",
        keep_fp32=[nn.BatchNorm2d],
    )
    state = guard.state_dict()
    assert state["forensics"]["keep_fp32"] == _bns(model)
    torch.save(state, tmp_path / "guard.pt")
    model2 = resnet_like()
    again = ag.Guard(
        model2,
        torch.optim.SGD(model2.parameters(), lr=0.1),
        precision="fp16",
        keep_fp32=[nn.BatchNorm2d],
    )
    again.load_state_dict(torch.load(tmp_path / "guard.pt", weights_only=True))
    assert again.state_dict()["forensics"] == state["forensics"]


def test_the_standalone_helper_takes_classes_too():
    model = resnet_like()
    with keep_fp32(model, [nn.BatchNorm2d]) as islands:
        assert islands.modules == tuple(_bns(model))
