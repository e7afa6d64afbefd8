"""Telemetry: per-step AMP records kept on the device and written to the run folder lazily.

Every step the Guard's hooks record the loss scale after the step, the packed step flags
(applied, overflow per optimizer, collapse, dropped micro-batches) and the loss: the flags and the
loss are tensors the step made anyway, kept by reference; the scale, updated in place, is read
from host memory on the CPU and copied into a preallocated device buffer elsewhere. Every
``layer_every`` steps: the unscaled total and per-layer gradient norms (one multi-tensor norm: the
cost does not grow with the number of parameter tensors); every ``range_every`` steps: a
per-layer exponent histogram of the unscaled gradients, from which the host derives the fraction
of exact zeros, fp16 headroom, underflow and the safe loss-scale window.
Every ``flush_every`` steps (and on ``flush``, ``close``, ``Guard.state_dict``) the kept tensors
are gathered into the buffer and it is copied to the host in one transfer, so between flushes
telemetry adds no host sync; on CUDA the copy goes to pinned memory without blocking and is
written out at the next flush. The host formats the run-log lines from the copied columns.

Modules (the recorder on top, the pieces it drives below):

- ``_telemetry``: :class:`Telemetry` (the producer hooks, the sampling, the flush) and
  :func:`attach` / :func:`check_argument` (a producer's ``telemetry=`` argument);
- ``_run_writer``: the run folder's one writer (lock, log, ``meta.json``, ``findings.json``,
  the sinks), each write under the write-error policy;
- ``source``: :class:`TelemetrySource`, the producer side of the contract (a Guard, a watch);
- ``_rows``: the named records a step leaves until the flush (``StepRow``, ``Sample``);
- ``_device``: the preallocated device buffer and the host view of the scale;
- ``_staging``: the device-to-host copy (pinned and non-blocking on CUDA);
- ``_records``: one flush's columns -> run-log lines, and the running tallies;
- ``_layers``: the parameter layout (layers, range chunks) and ``meta.json``'s content;
- ``_range_sample``: the per-layer exponent histogram of the gradients (fp16 range);
- ``_absorbed``: absorbed overflow (inf/NaN from finite inputs) on sampled forwards;
- ``_disk``: the full-disk policy (``on_write_error``);
- ``_tensorboard``: the optional TensorBoard sink.

>>> with ag.Guard(model, opt, precision="fp16", telemetry="runs/exp1") as guard:
...     for x, y in data:
...         with guard.autocast():
...             loss = loss_fn(model(x), y)
...         guard.backward(loss)
...         result = guard.step()
>>> path = ag.report("runs/exp1")   # runs/exp1/report.html
"""

from ampguard.telemetry._rows import Resumed
from ampguard.telemetry._telemetry import Telemetry, TelemetryError, attach, check_argument
from ampguard.telemetry.source import TelemetrySource

__all__ = [
    "Resumed",
    "Telemetry",
    "TelemetryError",
    "TelemetrySource",
    "attach",
    "check_argument",
]
