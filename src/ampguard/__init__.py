"""ampguard: robust, observable and debuggable mixed-precision training for PyTorch.

Public names are re-exported lazily (PEP 562) so that ``ampguard lint`` and other torch-free
entry points start without importing torch. ``from ampguard import Guard`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ampguard._version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Finding": "ampguard.findings",
    "resolve_precision": "ampguard.core.policy",
    "PrecisionPolicy": "ampguard.core.policy",
    "ScalerConfig": "ampguard.core.scaler",
    "LossScaler": "ampguard.core.scaler",
    "ScaleCollapseError": "ampguard.core.scaler",
    "Guard": "ampguard.guard",
    "StepResult": "ampguard.guard",
    "ResumeWarmup": "ampguard.core.resume",
    "CheckpointError": "ampguard.checkpoint",
    "save_checkpoint": "ampguard.checkpoint",
    "load_checkpoint": "ampguard.checkpoint",
    "DesyncError": "ampguard.distributed",
    "PeerFailureError": "ampguard.distributed",
    "LossSpikeError": "ampguard.replay",
    "autopsy": "ampguard.guard",
    "SpikeDiagnosis": "ampguard.guard",
    "save_distributed_checkpoint": "ampguard.checkpoint.distributed",
    "load_distributed_checkpoint": "ampguard.checkpoint.distributed",
    "locate": "ampguard.forensics",
    "Diagnosis": "ampguard.forensics",
    "triage": "ampguard.forensics",
    "TriageEvent": "ampguard.forensics",
    "SignatureRecorder": "ampguard.forensics",
    "coverage": "ampguard.forensics.autocast_coverage",
    "Coverage": "ampguard.forensics.autocast_coverage",
    "Experiment": "ampguard.experiments",
    "Comparison": "ampguard.experiments",
    "compare": "ampguard.experiments",
    "recipe_search": "ampguard.experiments",
    "RecipeCertificate": "ampguard.experiments",
    "inspect_model": "ampguard.experiments.advisor",
    "watch": "ampguard.integrations.watch",
    "watch_ema": "ampguard.core.ema",
    "EmaWatch": "ampguard.core.ema",
    "lint_source": "ampguard.lint",
    "lint_paths": "ampguard.lint",
    "Telemetry": "ampguard.telemetry",
    "TelemetryError": "ampguard.telemetry",
    "RuleConfig": "ampguard.rules",
    "report": "ampguard.reporting",
    "SyncCounter": "ampguard.testing",
    "fp8_plan": "ampguard.fp8",
    "Fp8Plan": "ampguard.fp8",
    "Fp8Thresholds": "ampguard.fp8",
    "conv1d_to_linear": "ampguard.fp8",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # the names for type checkers and the docs (griffe): mirrors _EXPORTS
    from ampguard.checkpoint import CheckpointError as CheckpointError
    from ampguard.checkpoint import load_checkpoint as load_checkpoint
    from ampguard.checkpoint import save_checkpoint as save_checkpoint
    from ampguard.checkpoint.distributed import (
        load_distributed_checkpoint as load_distributed_checkpoint,
    )
    from ampguard.checkpoint.distributed import (
        save_distributed_checkpoint as save_distributed_checkpoint,
    )
    from ampguard.core.ema import EmaWatch as EmaWatch
    from ampguard.core.ema import watch_ema as watch_ema
    from ampguard.core.policy import PrecisionPolicy as PrecisionPolicy
    from ampguard.core.policy import resolve_precision as resolve_precision
    from ampguard.core.resume import ResumeWarmup as ResumeWarmup
    from ampguard.core.scaler import LossScaler as LossScaler
    from ampguard.core.scaler import ScaleCollapseError as ScaleCollapseError
    from ampguard.core.scaler import ScalerConfig as ScalerConfig
    from ampguard.distributed import DesyncError as DesyncError
    from ampguard.distributed import PeerFailureError as PeerFailureError
    from ampguard.experiments import Comparison as Comparison
    from ampguard.experiments import Experiment as Experiment
    from ampguard.experiments import RecipeCertificate as RecipeCertificate
    from ampguard.experiments import compare as compare
    from ampguard.experiments import recipe_search as recipe_search
    from ampguard.experiments.advisor import inspect_model as inspect_model
    from ampguard.findings import Finding as Finding
    from ampguard.forensics import Diagnosis as Diagnosis
    from ampguard.forensics import SignatureRecorder as SignatureRecorder
    from ampguard.forensics import TriageEvent as TriageEvent
    from ampguard.forensics import locate as locate
    from ampguard.forensics import triage as triage
    from ampguard.forensics.autocast_coverage import Coverage as Coverage
    from ampguard.forensics.autocast_coverage import coverage as coverage
    from ampguard.fp8 import Fp8Plan as Fp8Plan
    from ampguard.fp8 import Fp8Thresholds as Fp8Thresholds
    from ampguard.fp8 import conv1d_to_linear as conv1d_to_linear
    from ampguard.fp8 import fp8_plan as fp8_plan
    from ampguard.guard import Guard as Guard
    from ampguard.guard import SpikeDiagnosis as SpikeDiagnosis
    from ampguard.guard import StepResult as StepResult
    from ampguard.guard import autopsy as autopsy
    from ampguard.integrations.watch import watch as watch
    from ampguard.lint import lint_paths as lint_paths
    from ampguard.lint import lint_source as lint_source
    from ampguard.replay import LossSpikeError as LossSpikeError
    from ampguard.reporting import report as report
    from ampguard.rules import RuleConfig as RuleConfig
    from ampguard.telemetry import Telemetry as Telemetry
    from ampguard.telemetry import TelemetryError as TelemetryError
    from ampguard.testing import SyncCounter as SyncCounter


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ampguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
