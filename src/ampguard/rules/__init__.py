"""Runtime rules: findings over a run log written by :class:`ampguard.Telemetry`.

Every threshold is a field of :class:`RuleConfig` (with its default). Warm-up is excluded where the
rule is about a steady state: from the run start (and from a resume that reset the scale) until
the first scale growth or ``warmup_clean_steps`` consecutive applied steps, at most
``warmup_max_steps`` steps, the scale is still finding its level from ``init_scale`` and its
overflows are expected.

The codes, their titles, severities, what fires each and the fix come from one catalogue,
:data:`ampguard.findings.codes.CATALOGUE` (the runtime area), and are listed on the generated
findings page (``docs/findings.md``); :data:`TITLES` reads it. A rule is a module here: its
thresholds are fields of :class:`RuleConfig`, and :func:`evaluate` runs every rule.
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
