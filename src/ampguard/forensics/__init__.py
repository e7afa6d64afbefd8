"""Forensics: which module and op produced the first non-finite value, in which pass, and why.

:func:`triage` tells hardware from math for a failed step (numerics, model or data, a transient
or a persistent fault; AG380-AG383) by deterministic replay against sync-free signatures kept by
:class:`SignatureRecorder` (see docs/triage.md).

:func:`locate` replays one batch like a training step (forward under autocast, backward of
``loss * scale``) with every aten op traced, once in the requested low precision and once in
fp32, and compares them:

========================  =====  ==============================================================
kind                      code   meaning
========================  =====  ==============================================================
``"none"``                AG300  loss and gradients are finite, nothing flushed to zero
``"fp16_overflow"``       AG301  non-finite only in low precision (beyond its range), fp32 fine
``"fp16_underflow"``      AG302  a layer's gradients are all zero in low precision, not in fp32
``"model_nonfinite"``     AG303  fp32 goes non-finite too: not an AMP problem
``"input_nonfinite"``     AG304  the batch itself holds NaN/inf
``"none"`` (benign)       AG305  a backward overflow that vanishes at loss scale 1: the scaler
                                 probing its level; GradScaler skips the step and halves the
                                 scale, nothing to fix
``"precision_stagnation"``  AG365  ``optimizer=``: one optimizer step left most of a bf16/fp16
                                 layer's intended updates rounded away (phase "optimizer");
                                 ``ema=``: the same for one ``lerp_`` of an EMA/teacher
``"eps_underflow"``       AG366  ``optimizer=``: its eps rounds to 0 in the fp16/bf16 weights'
                                 dtype, so Adam writes inf/NaN (phase "optimizer")
========================  =====  ==============================================================

Non-finite *state*: non-finite parameters can only have been written by an optimizer step, so
they are ``model_nonfinite`` in phase ``"optimizer"`` (``eps_underflow`` when ``optimizer=``'s eps
underflows their dtype). Non-finite *buffers* with finite parameters (a BatchNorm whose fp16
forward overflowed and whose step was skipped without restoring them) do not stop the replay:
a train-mode forward reads the batch's statistics, not the running ones. When this batch's low
precision forward overflows and fp32 does not, the diagnosis is the overflow (an AMP problem,
``stats["poisoned_buffers"]``: this forward poisoned them); when the batch replays clean, the state
was broken before the step (``model_nonfinite``, ``stats["broken_before_step"]``).

``module`` follows :mod:`ampguard.forensics._optrace`: in forward, the innermost module whose own
code ran
the op; in backward, the module whose forward created the autograd node that produced the value
(a gradient cast down to an fp16 activation belongs to the module that produced the activation).
"""

from ampguard.forensics._absorbed_scan import diagnose_absorbed, scan_every
from ampguard.forensics._diagnosis import CODES, KINDS, Diagnosis
from ampguard.forensics._live import check as check_arguments
from ampguard.forensics._live import diagnose_trace, fallback_finding, reproduced
from ampguard.forensics._locate import locate
from ampguard.forensics._optrace import OpTrace, flatten_tensors, op_name, user_line
from ampguard.forensics._signatures import SignatureRecorder, StepSignature
from ampguard.forensics._transient import soften
from ampguard.forensics._triage import CAUSES, TriageEvent, triage, triage_step
from ampguard.forensics._verdicts import advice, verdict

__all__ = [
    "Diagnosis",
    "locate",
    "KINDS",
    "CODES",
    "diagnose_absorbed",
    "scan_every",
    "check_arguments",
    "diagnose_trace",
    "fallback_finding",
    "reproduced",
    "OpTrace",
    "flatten_tensors",
    "op_name",
    "user_line",
    "soften",
    "advice",
    "verdict",
    "CAUSES",
    "SignatureRecorder",
    "StepSignature",
    "TriageEvent",
    "triage",
    "triage_step",
]
