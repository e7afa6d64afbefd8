"""A confirmed fp16 overflow that came and went: a warning that says so, not an error.

The Guard's forensics confirms an overflow (AG301) on the steps it diagnosed. When that happened
on a few steps close together and no overflow was diagnosed again over a long quiet stretch
after them (the loss scale backed off, the run went on), the skipped steps absorbed it: an
outlier batch, a transient spike. Telling the user to keep the module in fp32 or to switch to
bf16 would demand a change the run did not need, so :func:`soften` turns such a finding into a
warning with that explanation and keeps the fix for the case where it recurs.

========================  ======  =========================================================
what                      value   why
========================  ======  =========================================================
:data:`MAX_STEPS`         5       "a few steps": more diagnosed steps is a pattern, not a spike
:data:`MAX_SPAN`          10      the steps lie within this many steps of each other
:data:`MIN_QUIET`         20      steps after the last one with no further diagnosis, at
                                  least twice the burst's span
========================  ======  =========================================================
"""

from __future__ import annotations

from dataclasses import replace

from ampguard.findings import Finding

__all__ = ["MAX_STEPS", "MAX_SPAN", "MIN_QUIET", "soften", "is_transient"]

MAX_STEPS = 5
MAX_SPAN = 10
MIN_QUIET = 20
_CODES = ("AG301",)  # an fp16 range overflow; a model (AG303) or input (AG304) NaN stays an error


def is_transient(steps: list[int], last_diagnosed: int, now: int) -> bool:
    """``steps`` (one finding's diagnosed steps) are a burst that has not recurred: at most
    :data:`MAX_STEPS` of them within :data:`MAX_SPAN` steps, no diagnosis of any kind after
    them (``last_diagnosed``: the latest diagnosed step), and at least ``max(MIN_QUIET, 2 x
    span)`` steps run since (``now``: windows completed)."""
    if not steps or len(steps) > MAX_STEPS:
        return False
    span = max(steps) - min(steps)
    quiet = now - max(steps)
    return span <= MAX_SPAN and last_diagnosed <= max(steps) and quiet >= max(MIN_QUIET, 2 * span)


def soften(finding: Finding, steps: list[int], last_diagnosed: int, now: int) -> Finding:
    """``finding`` as a warning that explains the burst, when :func:`is_transient` says it was
    one (and it is an AG301 error); else ``finding`` unchanged. Cost: host only."""
    if finding.code not in _CODES or finding.severity != "error":
        return finding
    if not is_transient(steps, last_diagnosed, now):
        return finding
    first, last = min(steps), max(steps)
    where = f"step {first}" if first == last else f"steps {first}-{last}"
    quiet = now - last
    message = (
        f"{finding.message} It happened on {where} only ({len(steps)} "
        f"step{'s' if len(steps) != 1 else ''}, each skipped) and did not recur in the {quiet} "
        "steps since, after the loss scale backed off: a transient burst (an outlier batch or "
        "a spike) that skipping absorbed, so the run needs no change now."
    )
    fix = (
        "Nothing to change while it stays this rare: the skipped steps lost no weights. If it "
        f"recurs (AG301 again, or AG101/AG103 in the report): {finding.fix}"
    )
    evidence = {**finding.evidence, "transient": True, "quiet_steps": quiet}
    return replace(finding, severity="warning", message=message, fix=fix, evidence=evidence)
