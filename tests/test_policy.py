"""Precision policy: resolution per device, scaler need, autocast factory, parameter checks."""

import pytest
import torch
from _precisions import plain

from ampguard.core.policy import (
    PRECISIONS,
    PrecisionPolicy,
    check_parameters,
    device_of,
    resolve_precision,
    supports_bf16,
)


def test_auto_resolves_to_bf16_on_cpu():
    assert resolve_precision("auto", "cpu").precision == "bf16"


def test_auto_resolves_to_fp16_where_bf16_is_unsupported():
    # "meta" has no bf16 autocast, so auto must fall back to fp16 (the only other AMP dtype).
    assert not supports_bf16("meta")
    assert resolve_precision("auto", "meta").precision == "fp16"


@pytest.mark.parametrize("request_", plain())
def test_explicit_request_is_kept(request_):
    policy = resolve_precision(request_, torch.device("cpu"))
    assert (policy.precision, policy.device_type) == (request_, "cpu")


@pytest.mark.parametrize("bad", ["fp4", "float16", "", "FP16"])
def test_unknown_precision_is_a_value_error_listing_the_choices(bad):
    with pytest.raises(ValueError, match="precision must be one of") as info:
        resolve_precision(bad, "cpu")
    for name in PRECISIONS:
        assert name in str(info.value)


def test_bf16_on_a_device_without_bf16_autocast_is_refused():
    with pytest.raises(ValueError, match="precision='bf16' is not supported"):
        resolve_precision("bf16", "meta")


@pytest.mark.parametrize(
    ("precision", "dtype", "needs_scaler"),
    [("fp16", torch.float16, True), ("bf16", torch.bfloat16, False), ("fp32", None, False)],
)
def test_dtype_and_scaler_need(precision, dtype, needs_scaler):
    policy = PrecisionPolicy(precision, "cpu")
    assert policy.dtype is dtype
    assert policy.needs_scaler is needs_scaler


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_autocast_runs_matmuls_in_the_policy_dtype(precision, dtype):
    layer = torch.nn.Linear(8, 4)
    with PrecisionPolicy(precision, "cpu").autocast():
        out = layer(torch.randn(2, 8))
    assert out.dtype is dtype
    assert layer.weight.dtype is torch.float32


def test_fp32_autocast_is_off():
    with PrecisionPolicy("fp32", "cpu").autocast():
        assert not torch.is_autocast_enabled("cpu")
        out = torch.nn.Linear(8, 4)(torch.randn(2, 8))
    assert out.dtype is torch.float32


def test_autocast_enabled_false_turns_autocast_off():
    with PrecisionPolicy("fp16", "cpu").autocast(enabled=False):
        assert not torch.is_autocast_enabled("cpu")


def test_device_of_is_the_first_parameters_device():
    assert device_of(torch.nn.Linear(2, 2).parameters()) == torch.device("cpu")


def test_device_of_empty_parameters_is_a_value_error():
    with pytest.raises(ValueError, match="no parameters"):
        device_of([])


def test_check_parameters_refuses_an_empty_list_naming_the_argument():
    with pytest.raises(ValueError, match="^optimizer has no parameters"):
        check_parameters([], PrecisionPolicy("fp16", "cpu"), argument="optimizer")


def test_check_parameters_refuses_integer_parameters():
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)]
    with pytest.raises(ValueError, match="non-floating parameter of dtype torch.int64"):
        check_parameters(params, PrecisionPolicy("bf16", "cpu"), argument="optimizer")


def test_check_parameters_explains_half_models_under_fp16():
    params = list(torch.nn.Linear(2, 2).half().parameters())
    with pytest.raises(ValueError, match="fp32 master weights") as info:
        check_parameters(params, PrecisionPolicy("fp16", "cpu"), argument="optimizer")
    assert ".half()" in str(info.value)


@pytest.mark.parametrize("precision", plain(scaled=False))
def test_half_parameters_are_allowed_without_a_scaler(precision):
    params = list(torch.nn.Linear(2, 2).half().parameters())
    check_parameters(params, PrecisionPolicy(precision, "cpu"), argument="optimizer")
