"""fp8 readiness plan: which ``nn.Linear`` layers can train in fp8, and why not, before training.

Modules that do matmuls but are not ``nn.Linear`` (transformers ``Conv1D``, ...) are named in
``plan.unconvertible`` with their fix (:mod:`ampguard.fp8._modules`, ``ag.conv1d_to_linear``).

One traced forward + backward in bf16 autocast captures every Linear layer's input, weight and
output gradient; each is cast as torchao's float8 training would cast it (``recipe``:
``"tensorwise"`` or ``"rowwise"``, see :mod:`ampguard.fp8._cast`) and measured:

- ``eligible``: in and out features are multiples of 16 (what fp8 matmuls, ``torch._scaled_mm``,
  accept);
- ``sqnr_db``: the layer's output (no bias) from e4m3 input and weight against the bf16 output;
- ``input_flushed`` / ``weight_flushed``: share of the nonzero values that become zero in e4m3
  (an outlier feature sets the amax and pushes ordinary values below e4m3's smallest subnormal);
- ``grad_flushed``: the same for the output gradient in the recipe's gradient dtype (e5m2 under
  ``"tensorwise"``, e4m3 under torchao's ``"rowwise"``).

A layer is *ready* when it is eligible and no figure crosses its :class:`Fp8Thresholds` limit.
``plan.module_filter_fn`` hands the verdict to ``torchao.float8.convert_to_float8_training``;
``ag.Guard(..., precision="fp8", fp8_plan=plan)`` uses it directly. This module needs torch only.
(It is not called ``fp8_plan``: importing ``ampguard.fp8_plan`` would then replace the
``ampguard.fp8_plan`` function with the module.)

>>> plan = ag.fp8_plan(model, loss_fn, batch)        # loss_fn(model, batch) -> scalar loss
>>> print(plan.summary())
>>> guard = ag.Guard(model, opt, precision="fp8", fp8_plan=plan)
"""

from ampguard.fp8._conversion import Conversion
from ampguard.fp8._emulate import emulate, restore
from ampguard.fp8._fidelity import (
    converted,
    failing,
    gradient_fidelity,
    losing_inputs,
    lost_progress,
    reference_gradients,
)
from ampguard.fp8._formats import FORMATS, check_formats
from ampguard.fp8._layered import RECIPE_FORMAT
from ampguard.fp8._modules import CONV1D_FIX, conv1d_to_linear, is_hf_conv1d, unconvertible
from ampguard.fp8._plan import FIXES, Fp8Plan, Fp8Thresholds, fp8_plan
from ampguard.fp8._recipe import HIGH
from ampguard.fp8._torchao import Fp8UnavailableError, require_torchao

__all__ = [
    "Fp8Plan",
    "Fp8Thresholds",
    "fp8_plan",
    "FIXES",
    "FORMATS",
    "conv1d_to_linear",
    "Conversion",
    "emulate",
    "restore",
    "converted",
    "failing",
    "gradient_fidelity",
    "losing_inputs",
    "lost_progress",
    "reference_gradients",
    "check_formats",
    "RECIPE_FORMAT",
    "CONV1D_FIX",
    "is_hf_conv1d",
    "unconvertible",
    "HIGH",
    "Fp8UnavailableError",
    "require_torchao",
]
