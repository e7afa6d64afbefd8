"""ampguard: robust, observable and debuggable mixed-precision training for PyTorch.

Public names are re-exported lazily (PEP 562) so that ``ampguard lint`` and other torch-free
entry points start without importing torch. ``from ampguard import Guard`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Finding": "ampguard.findings",
    "resolve_precision": "ampguard.policy",
    "PrecisionPolicy": "ampguard.policy",
    "ScalerConfig": "ampguard.scaler",
    "LossScaler": "ampguard.scaler",
    "ScaleCollapseError": "ampguard.scaler",
    "Guard": "ampguard.guard",
    "StepResult": "ampguard.guard",
    "ResumeWarmup": "ampguard.resume",
    "CheckpointError": "ampguard.checkpoint",
    "save_checkpoint": "ampguard.checkpoint",
    "load_checkpoint": "ampguard.checkpoint",
    "DesyncError": "ampguard.distributed",
    "PeerFailureError": "ampguard.distributed",
    "save_distributed_checkpoint": "ampguard.checkpoint_dist",
    "load_distributed_checkpoint": "ampguard.checkpoint_dist",
    "locate": "ampguard.forensics",
    "Diagnosis": "ampguard.forensics",
    "coverage": "ampguard.autocast_coverage",
    "Coverage": "ampguard.autocast_coverage",
    "Experiment": "ampguard.experiments",
    "Comparison": "ampguard.experiments",
    "compare": "ampguard.experiments",
    "inspect_model": "ampguard.advisor",
    "watch": "ampguard.integrations.watch",
    "lint_source": "ampguard.lint",
    "lint_paths": "ampguard.lint",
    "Telemetry": "ampguard.telemetry",
    "RuleConfig": "ampguard.rules",
    "report": "ampguard.reporting",
    "SyncCounter": "ampguard.testing",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ampguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
