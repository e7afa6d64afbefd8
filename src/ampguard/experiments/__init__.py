"""A/B experiments: train the same model from the same weights and data in fp32, fp16 and bf16.

``compare(factory)`` automates the usual AMP troubleshooting routine. ``factory()`` returns a
fresh :class:`Experiment` each call; every variant seeds the RNGs, calls it afresh and trains
``steps`` steps. The :class:`Comparison` holds per-variant loss curves, the largest relative
deviation from fp32, throughput relative to fp32, skipped steps and the final loss scale, and a
verdict with an explanation and a fix:

- ``amp_ok`` (AG333): fp16 with dynamic scaling trains like fp32.
- ``dynamic_scale_conflict`` (AG334): dynamic scaling fails but a fixed scale of 64 trains.
- ``fp16_range`` (AG335): the fixed scale fails too: values leave fp16's range. The first
  failing batch is named and, where :mod:`ampguard.forensics` is available, ``locate`` runs on it.
- ``model_problem`` (AG336): fp32 fails too; not an AMP issue.
- ``silent_stall`` (AG367): a low-precision variant stays finite and skips little, but its loss
  ends far above fp32's at the same applied steps; ``locate`` (with ``optimizer=``) runs on its
  last batch from its final weights and names the layer (:mod:`ampguard.experiments._stall`).

Opt-in variants ``fp8`` and ``fp8_planned`` (torchao float8, see :mod:`ampguard.experiments._fp8`)
are judged against bf16 too, with verdicts ``fp8_ok``/``fp8_keep_layers``/``fp8_fails``
(AG337-AG339) naming the layers to keep out of fp8.

(The module is not called ``compare``: ``import ampguard.compare`` would then replace the
``ampguard.compare`` function with the module.)
"""

from ampguard.experiments._certificate import RecipeCertificate
from ampguard.experiments._compare import compare
from ampguard.experiments._recipe_search import recipe_search
from ampguard.experiments._results import VERDICTS, Comparison, Experiment, VariantResult
from ampguard.experiments._variants import VARIANTS, seed_all

__all__ = [
    "Experiment",
    "Comparison",
    "VariantResult",
    "VARIANTS",
    "VERDICTS",
    "compare",
    "seed_all",
    "recipe_search",
    "RecipeCertificate",
]
