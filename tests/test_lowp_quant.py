"""The plan's own casts (ampguard.fp8._quant) are bitwise the casts they stand for: torchao's
MXTensor.to_mx (RCEIL) and NVFP4Tensor.to_nvfp4 then dequantize, the float8 recipes of
ampguard.fp8._cast, and torch's own fp8 casts for the rounding step; on Gaussian tensors, an
outlier feature channel, heavy-tailed rows, zeros and tiny values that reach the subnormals."""

from __future__ import annotations

import pytest
import torch

from ampguard.fp8._cast import E4M3, E5M2, RECIPES, quantize
from ampguard.fp8._formats import FORMATS
from ampguard.fp8._multi import LayerMeasure
from ampguard.fp8._operand import Operand
from ampguard.fp8._quant import CASTS, ELEMENTS, round_to_grid

pytest.importorskip("torchao")


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gauss = torch.randn(64, 256, generator=gen)
    outlier = gauss.clone()
    outlier[:, 7] = 3e4  # one feature channel far above the rest
    heavy = torch.randn(64, 256, generator=gen) * torch.exp2(torch.randint(-40, 20, (64, 1)))
    sparse = gauss * (torch.rand(64, 256, generator=gen) > 0.7)
    sparse[3] = 0.0  # an all-zero row and all-zero blocks
    tiny = torch.randn(64, 256, generator=gen) * 1e-30
    tiny[0, 0] = 1.0  # everything else in the subnormals of every element type
    out = dict(gauss=gauss, outlier=outlier, heavy=heavy, sparse=sparse, tiny=tiny)
    return {k: v.to(torch.bfloat16) for k, v in out.items()}  # what the plan measures


TENSORS = _tensors()


def _torchao(name: str, x: torch.Tensor, role: str) -> torch.Tensor:
    return FORMATS[name].quantize(x.float(), role)[0]  # the registry's torchao quantiser


@pytest.mark.parametrize("role", ["input", "weight", "grad"])
@pytest.mark.parametrize("name", sorted(FORMATS))  # every format: its cast is the reference
@pytest.mark.parametrize("kind", sorted(TENSORS))
def test_the_plan_cast_is_bitwise_the_reference(kind, name, role):
    x = TENSORS[kind]
    ours = CASTS[name](Operand(x), role)
    ref = _torchao(name, x, role)
    assert torch.equal(ours.q, ref), (kind, name, role, (ours.q != ref).sum())
    if name in ("tensorwise", "rowwise"):  # and the fp8 plan's own cast
        rec = RECIPES[name]
        dtype = rec.grad_dtype if role == "grad" else E4M3
        assert torch.equal(ours.q, quantize(x, dtype, rec))


def test_an_all_zero_tensor_casts_as_torchao_does():
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    for name in FORMATS:
        ours, ref = CASTS[name](Operand(x), "input").q, _torchao(name, x, "input")
        assert torch.equal(ours.isnan(), ref.isnan()), name  # NVFP4: NaN, as torchao's
        assert torch.equal(ours.nan_to_num(), ref.nan_to_num()), name


@pytest.mark.parametrize(("element", "dtype"), [("e4m3", E4M3), ("e5m2", E5M2)])
def test_round_to_grid_is_torchs_fp8_cast(element, dtype):
    el = ELEMENTS[element]
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(1 << 16, generator=gen) * torch.exp2(torch.randint(-30, 16, (1 << 16,)))
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    ties = (grid[:-1] + grid[1:]) / 2  # midpoints between neighbouring values: to even
    t = torch.cat([t, grid, ties, -ties]).clamp(-el.max, el.max)
    t = t[t.isfinite()]
    assert torch.equal(round_to_grid(t.clone(), el), t.to(dtype).float())


def test_round_to_grid_is_torchaos_e2m1():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])
    t = torch.cat([torch.linspace(-6, 6, 100001), (grid[:-1] + grid[1:]) / 2, -grid])
    ref = f4_unpacked_to_f32(f32_to_f4_unpacked(t))
    assert torch.equal(round_to_grid(t.clone(), ELEMENTS["e2m1"]), ref)


def _reference_figures(x: torch.Tensor, name: str, role: str) -> dict[str, float]:
    """The figures as the plan defined them before the shared-tensor rewrite: elementwise on
    the torchao cast and its per-value scale."""
    fmt = FORMATS[name]
    xf = x.float()
    q, scale = fmt.quantize(xf, role)
    mags = xf.abs()
    nonzero = mags > 0
    count = nonzero.sum().clamp(min=1).float()
    top = 6.0 if fmt.element(role) == "e2m1" else ELEMENTS[fmt.element(role)].max
    limit = scale * (top * (1 + 2.0 ** -(fmt.mantissa_bits + 1)))
    return {
        "saturated": float((mags > limit).sum() / count),
        "flushed": float((nonzero & (q == 0)).sum() / count),
        "sqnr_db": float(10 * torch.log10(mags.pow(2).sum() / (xf - q).pow(2).sum())),
    }


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("kind", ["gauss", "outlier", "heavy", "sparse"])
def test_the_shared_tensor_figures_are_the_elementwise_figures(kind, name):
    x = TENSORS[kind]
    w = TENSORS["gauss"][:32]
    figs = LayerMeasure(x, w, x).figures(name)
    for role in ("input", "grad"):
        ref = _reference_figures(x, name, role)
        assert figs[f"{role}_saturated"] == pytest.approx(ref["saturated"], abs=1e-9)
        assert figs[f"{role}_flushed"] == pytest.approx(ref["flushed"], abs=1e-9)
        assert figs[f"{role}_sqnr_db"] == pytest.approx(ref["sqnr_db"], abs=1e-3)


def test_saturation_is_counted_value_by_value_when_a_block_is_over():
    from ampguard.fp8._multi import _Role

    op = Operand(TENSORS["outlier"])
    role = _Role(op, FORMATS["mxfp8"], "input")
    role.limit = role.limit / 1e4  # as if the scales were 1e4x too small: the outlier clips
    over = int((role.cast.amax > role.limit).sum())
    assert over > 0
    count = int((op.abs.view(op.rows, -1, 32) > role.limit).sum())
    assert role.figures([1.0, 1.0, 1.0, 1.0, float(op.nonzero), 0.0, float(over)])["saturated"] == (
        pytest.approx(count / int(op.nonzero))
    )
