"""``evaluate``: every runtime rule over one run log, with the findings recorded during the run."""

from __future__ import annotations

from ampguard.findings import Finding
from ampguard.rules._agree import agree
from ampguard.rules._base import RuleConfig
from ampguard.rules._gaps import ag140
from ampguard.rules._layers import ag104, ag105, ag106, ag108
from ampguard.rules._nonfinite import ag109, ag110
from ampguard.rules._scale import ag101, ag102, ag103, ag107
from ampguard.rules._silent import ag170, ag171
from ampguard.rules._warmup import warmup_mask
from ampguard.runlog import RunLog

__all__ = ["evaluate"]


def evaluate(run: RunLog, config: RuleConfig | None = None) -> list[Finding]:
    """All AG1xx findings for ``run``, most severe first, then by step."""
    cfg = config or RuleConfig()
    if not isinstance(cfg, RuleConfig):
        raise TypeError(f"config must be an ampguard.rules.RuleConfig, got {type(cfg).__name__}")
    warm = warmup_mask(run, cfg)
    found: list[Finding] = []
    for rule in (
        ag101,
        ag102,
        ag103,
        ag104,
        ag105,
        ag106,
        ag107,
        ag108,
        ag109,
        ag110,
        ag170,
        ag171,
    ):
        found.extend(rule(run, cfg, warm))
    found.extend(ag140(run, cfg, warm))  # steps a full disk kept out of the log
    # --- findings recorded during the run (forensics, distributed, attach mode) ---
    recorded = {
        (e["finding"]["code"], e["finding"]["title"]): Finding.from_dict(e["finding"])
        for e in run.events
        if e.get("kind") == "finding" and "finding" in e
    }
    found.extend(recorded.values())  # the last event per code and title wins
    # --- end of recorded findings ---
    found = agree(found)  # the scale/gradient advice follows the forensic verdict (rules._agree)
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda f: (order[f.severity], f.step or 0, f.code))
