"""Attach mode and framework integrations.

``ampguard.watch`` (:mod:`.watch`) attaches to a loop's own ``torch.amp.GradScaler``. The framework
modules import their framework on import and fail with a clear ``ImportError`` naming the extra
(``pip install "ampguard[integrations]"``) when it is missing:

- :mod:`ampguard.integrations.transformers`: ``AmpGuardCallback`` for the HF ``Trainer``
- :mod:`ampguard.integrations.lightning`: ``AmpGuardCallback`` for the Lightning ``Trainer``
- :mod:`ampguard.integrations.accelerate`: ``watch_accelerator`` for an Accelerate loop
- :mod:`ampguard.integrations.sinks`: optional W&B / MLflow sinks for a run's records
"""

from ampguard.integrations._policy import grad_scaler, guard_options
from ampguard.integrations.watch import Watch, watch

__all__ = ["watch", "Watch", "grad_scaler", "guard_options"]
