"""Import the optional framework packages with an error that says which extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]

_EXTRA_OF = {
    "transformers": "integrations",
    "lightning": "integrations",
    "accelerate": "integrations",
    "deepspeed": "deepspeed",
    "wandb": "wandb",
    "mlflow": "mlflow",
}


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` naming the ampguard extra that provides it."""
    extra = _EXTRA_OF.get(module.split(".")[0], "integrations")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs the '{module.split('.')[0]}' package, which is not installed: "
            f'pip install "ampguard[{extra}]"'
        ) from exc
