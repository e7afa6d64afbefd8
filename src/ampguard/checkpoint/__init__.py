"""Safe checkpoints: atomic save, verified ``weights_only`` load, all-or-nothing resume.

A checkpoint is written to a temporary file in the target folder, fsynced and atomically renamed
over the target, so a crash at any moment leaves either the old or the new checkpoint, never a torn
one (``ampguard.checkpoint._files``). Loading checks the CRC-32 of every zip member, then always
uses
``torch.load(weights_only=True)``: no code from the file ever runs. The payload is then checked
against the live objects (``ampguard.checkpoint._validate``, ``Guard.check_state``) and copied
only
when everything fits, so a failed load leaves model, optimizer, scheduler, Guard and RNG as they
were. Every failure is a :class:`CheckpointError` naming the file.
"""

from ampguard.checkpoint._files import CheckpointError, atomic_write
from ampguard.checkpoint._single import load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "atomic_write"]
