"""Runtime rules: findings over a run log written by :class:`ampguard.Telemetry`.

Every threshold is a field of :class:`RuleConfig` (defaults below). Warm-up is excluded where the
rule is about a steady state: from the run start (and from a resume that reset the scale) until
the first scale growth or ``warmup_clean_steps`` consecutive applied steps, at most
``warmup_max_steps`` steps, the scale is still finding its level from ``init_scale`` and its
overflows are expected.

========  =====================  ===============================================================
code      title                  fires when
========  =====================  ===============================================================
AG101     loss scale collapse    a step overflowed at ``min_scale`` (error); or an overflow left
                                 the scale within ``collapse_floor_factor`` of ``min_scale``; or
                                 after warm-up it fell by ``2**collapse_halvings`` within
                                 ``collapse_window`` steps
AG102     loss scale oscillation ``osc_min_cycles`` or more grow -> overflow -> back-off cycles
                                 after warm-up, at least ``osc_min_rate`` cycles per step
AG103     high skip rate         after warm-up, more than ``skip_rate`` of the steps in some
                                 ``skip_window``-step window were skipped; a run with fewer
                                 than ``skip_min_steps`` steps after warm-up gets AG103 at info
                                 level (its skips by cause, not a verdict) when more than
                                 ``skip_rate`` of its steps were skipped for causes other than
                                 warm-up probing, or more than half of them in all
AG104     dead layer             a layer's gradient was all exact zeros on ``dead_steps``
                                 consecutive sampled applied steps while another layer's was not
AG105     fp16 saturation        a layer's largest unscaled gradient came within
                                 ``saturation_factor`` of fp16's max (65504) without overflowing
AG106     gradient underflow     on at least half of a layer's range samples, more than
                                 ``underflow_frac`` of its nonzero gradients were below fp16's
                                 smallest normal at the scale in use
AG107     resume gap             after a resume the scale differs from the one before the
                                 interruption by ``2**resume_gap_bits`` or more, or was reset to
                                 ``init_scale`` (checkpoint without scaler state)
AG108     bf16 recommended       on ``bf16_min_samples`` range samples the safe scale window was
                                 empty: no fp16 scale keeps the small gradients and the large ones
AG109     non-finite skips       without a loss scaler, steps were skipped for non-finite
                                 gradients (error once ``max_nonfinite_skips`` ran in a row)
AG110     non-finite applied     a watched step without a scaler applied non-finite gradients
AG170     absorbed fp16 overflow fp16 ops inside a module overflowed on an applied range-sampling
                                 step (telemetry's ``absorbed`` events; ``rules._silent``)
AG171     fp16 without a scaler  no loss scaler, and a layer's gradients underflow as in AG106
                                 (replaces AG106 for such a run; ``rules._silent``)
========  =====================  ===============================================================
"""

from ampguard.rules._base import TITLES, RuleConfig
from ampguard.rules._evaluate import evaluate
from ampguard.rules._ranges import BINS as RANGE_BINS
from ampguard.rules._ranges import E_MIN as RANGE_E_MIN
from ampguard.rules._ranges import summarize as summarize_ranges
from ampguard.rules._warmup import NONFINITE_FORWARD, skip_causes, warmup_mask

__all__ = [
    "RuleConfig",
    "evaluate",
    "warmup_mask",
    "skip_causes",
    "NONFINITE_FORWARD",
    "TITLES",
    "RANGE_BINS",
    "RANGE_E_MIN",
    "summarize_ranges",
]
