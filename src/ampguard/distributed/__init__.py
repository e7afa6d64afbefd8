"""The Guard under torch.distributed: setup detection, found_inf consensus, accumulation, audit.

Detected from the model, no flags needed: ``DistributedDataParallel`` ("ddp"), FSDP2
``fully_shard`` modules with DTensor parameters ("fsdp2"), or a plain model while a process group
with more than one rank is initialised ("process_group").

- **Consensus.** Each window, every rank writes its per-optimizer overflow flags (and, with
  containment, its dropped micro-batch count) into its own row of a small ``(world, n + 1)``
  tensor; ONE asynchronous ``all_reduce(MAX)`` gives every rank every row. The skip decision uses
  the column maxima, so all ranks skip or step together, and the rows say which rank overflowed
  (the overflow origin). Nothing is read on the host: the Guard reads its packed status exactly
  where torch's GradScaler would.
- **No consensus where it is redundant.** Under plain DDP (no comm hook, no containment, every
  optimized parameter reduced by DDP over the Guard's group) every rank steps on the same averaged
  gradients, and a non-finite value on one rank is non-finite in the average on all: each rank's
  own check already agrees, so no collective runs. The overflow origin then comes from each
  rank's own loss (non-finite or not; device flags, no sync), gathered by the next audit.
- **Peers.** ampguard's collectives run on a group of their own with ``timeout=peer_timeout``;
  a failed collective (ampguard's, or DDP's/FSDP2's inside the Guard's calls) raises
  :class:`PeerFailureError` naming the ranks that did not answer
  (:mod:`ampguard.distributed._peers`).
- **Accumulation.** Non-final micro-batches run under DDP's ``no_sync()`` or with FSDP2's
  ``set_requires_gradient_sync(False)``.
- **Audit.** Every ``audit_every`` windows (and at checkpoint time) one small all-reduce compares
  scale, growth/hysteresis trackers, step counts, precision and a parameter checksum across ranks;
  a mismatch raises :class:`DesyncError`, warns, or repairs from rank 0 (``on_desync``).

The DDP communication hook lives in :mod:`ampguard.distributed.hooks`, checkpoints in
:mod:`ampguard.checkpoint.distributed`.
"""

from ampguard.distributed._attach import (
    ON_DESYNC,
    attach,
    check_distributed_options,
    rank_telemetry,
)
from ampguard.distributed._checksum import param_checksum
from ampguard.distributed._errors import DesyncError, PeerFailureError
from ampguard.distributed._peers import is_comm_error, resolve_peer_timeout
from ampguard.distributed._state import DistributedState
from ampguard.distributed._topology import Topology, detect, fsdp_modules

__all__ = [
    "ON_DESYNC",
    "DesyncError",
    "PeerFailureError",
    "Topology",
    "detect",
    "DistributedState",
    "attach",
    "check_distributed_options",
    "param_checksum",
    "rank_telemetry",
    "fsdp_modules",
    "is_comm_error",
    "resolve_peer_timeout",
]
