"""ag.inspect_model looks inside modules: an fp16 op that overflows inside a
module whose output is in range (AG361), and a sigmoid feeding a BCE whose probabilities round
to exactly 0/1 in fp16 (AG362). Real fp16 autocast on the CPU; a firing and a silent case each.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampguard as ag

D = 32


class Attention(nn.Module):
    """Single-head attention; ``scale_first`` applies 1/sqrt(d) to q before the matmul."""

    def __init__(self, gain, scale_first=False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.scale_first = scale_first
        with torch.no_grad():
            self.q.weight.mul_(gain)
            self.k.weight.mul_(gain)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.scale_first:
            scores = (q * D**-0.5) @ k.transpose(-1, -2)
        else:
            scores = (q @ k.transpose(-1, -2)) / D**0.5
        return torch.softmax(scores.float(), -1).to(v.dtype) @ v


class AttnNet(nn.Module):
    def __init__(self, gain, scale_first=False):
        super().__init__()
        torch.manual_seed(0)
        self.attn = Attention(gain, scale_first)
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        return self.head(self.attn(x))


def attn_batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 8, D, generator=g), torch.randint(0, 4, (2,), generator=g)


def attn_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).mean(1).float(), y)


def codes(found):
    return {f.code for f in found}


def test_qk_overflow_inside_attention_is_named():
    model = AttnNet(gain=150.0)
    found = ag.inspect_model(model, attn_batch(), attn_loss)
    ag361 = [f for f in found if f.code == "AG361"]
    assert len(ag361) == 1
    f = ag361[0]
    assert list(f.evidence["modules"]) == ["attn"]
    assert f.evidence["modules"]["attn"]["op"] in ("aten.bmm", "aten.matmul", "aten.mm")
    assert f.evidence["modules"]["attn"]["max_abs_fp32"] > 65504
    assert "1/sqrt(d)" in f.message and "scaled_dot_product_attention" in f.fix
    assert "AG326" not in codes(found)  # the module-level check cannot see it
    plan = next(f for f in found if f.code == "AG331")
    assert plan.evidence["precision"] == "bf16" or "attn" in plan.evidence["keep_fp32"]


@pytest.mark.parametrize("gain, scale_first", [(1.0, False), (150.0, True)])
def test_qk_silent_when_it_fits_or_is_scaled_first(gain, scale_first):
    found = ag.inspect_model(AttnNet(gain, scale_first), attn_batch(), attn_loss)
    assert "AG361" not in codes(found)


def test_inner_probe_restores_the_model():
    model = AttnNet(gain=150.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ag.inspect_model(model, attn_batch(), attn_loss)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not torch.is_autocast_enabled("cpu")


class Classifier(nn.Module):
    def __init__(self, gain):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(D, 1)
        self.act = nn.Sigmoid()
        with torch.no_grad():
            self.fc.weight.mul_(gain)

    def forward(self, x):
        return self.act(self.fc(x)).squeeze(-1)


class LogitClassifier(Classifier):
    def forward(self, x):
        return self.fc(x).squeeze(-1)


def bce_batch():
    g = torch.Generator().manual_seed(4)
    return torch.randn(64, D, generator=g), (torch.rand(64, generator=g) > 0.5).float()


def bce(model, batch):
    return F.binary_cross_entropy(model(batch[0]).float(), batch[1])


def test_sigmoid_into_bce_one_confidently_wrong_sample_fires():
    found = ag.inspect_model(Classifier(gain=7.0), bce_batch(), bce)
    ag362 = [f for f in found if f.code == "AG362"]
    assert len(ag362) == 1
    ev = ag362[0].evidence
    assert ev == {"module": "act", "rounded": 1, "wrong": 1, "numel": 64}
    # one sample of 64 is far below the saturated share AG321 warns at (10%)
    assert all(f.severity == "info" for f in found if f.code == "AG321")
    assert "binary_cross_entropy_with_logits" in ag362[0].fix


def test_sigmoid_into_bce_silent_when_probabilities_stay_inside():
    assert "AG362" not in codes(ag.inspect_model(Classifier(gain=1.0), bce_batch(), bce))


def test_bce_with_logits_is_silent():
    def loss(model, batch):
        return F.binary_cross_entropy_with_logits(model(batch[0]).float(), batch[1])

    found = ag.inspect_model(LogitClassifier(gain=10.0), bce_batch(), loss)
    assert "AG362" not in codes(found)
