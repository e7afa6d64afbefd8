"""The AMP step's state and arithmetic: precision policy, loss scaler, scale history,
micro-batch containment, resume warm-up and step results. Imports no other ampguard package.
"""

from ampguard.core._args import (
    as_optimizers,
    check_backward,
    check_flag,
    check_grads_present,
    check_model,
    check_window,
    scheduler_callback,
)
from ampguard.core.containment import MicrobatchBuffer
from ampguard.core.policy import (
    PRECISIONS,
    PrecisionPolicy,
    check_parameters,
    device_of,
    resolve_precision,
    supports_bf16,
)
from ampguard.core.results import (
    Counters,
    Decoded,
    StepResult,
    add_collapse,
    decode,
    observed,
    pack,
)
from ampguard.core.resume import ResumeTracker, ResumeWarmup, WarmupRamp, scale_gap_bits
from ampguard.core.scale_history import ScaleHistory
from ampguard.core.scaler import (
    COLLAPSE_POLICIES,
    LossScaler,
    ScaleCollapseError,
    ScalerConfig,
    collect_grads,
)

__all__ = [
    "PRECISIONS",
    "PrecisionPolicy",
    "resolve_precision",
    "supports_bf16",
    "device_of",
    "check_parameters",
    "ScalerConfig",
    "LossScaler",
    "ScaleCollapseError",
    "COLLAPSE_POLICIES",
    "collect_grads",
    "ScaleHistory",
    "MicrobatchBuffer",
    "ResumeWarmup",
    "ResumeTracker",
    "WarmupRamp",
    "scale_gap_bits",
    "StepResult",
    "Decoded",
    "Counters",
    "pack",
    "observed",
    "add_collapse",
    "decode",
    "as_optimizers",
    "check_backward",
    "check_flag",
    "check_grads_present",
    "check_model",
    "check_window",
    "scheduler_callback",
]
