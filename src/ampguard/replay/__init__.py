"""The one replay engine: what every replay of a recorded training step stands on.

The device ring buffer of the flight recorder (:class:`FlightRecorder`) and its sampled
per-module output amax (:class:`OutputAmax`), the sync-free loss
spike detector (:class:`SpikeDetector`), snapshots of the loop's state (:class:`Snapshot`,
:class:`SnapshotStore`: weights, optimizer, schedulers, loss scale, RNG; one format, in memory or
on disk), the model state kept around a replay (:class:`Preserved`) and the RNG capture
(:func:`rng_state`). ``Guard(flight_recorder=...)``, the spike autopsy and forensics'
``locate`` replays all use these; the package sits below the Guard and forensics.
"""

from ampguard.replay._amax import OutputAmax, layers_of
from ampguard.replay._detector import SPIKE_RUN, LossSpikeError, SpikeDetector
from ampguard.replay._preserved import Preserved
from ampguard.replay._ring import FlightRecorder, grad_norms, local
from ampguard.replay._rng import rng_state, set_rng_state
from ampguard.replay._snapshot import Snapshot, SnapshotStore, state_bytes

__all__ = [
    "FlightRecorder",
    "SPIKE_RUN",
    "LossSpikeError",
    "OutputAmax",
    "Preserved",
    "Snapshot",
    "SnapshotStore",
    "SpikeDetector",
    "grad_norms",
    "layers_of",
    "local",
    "rng_state",
    "set_rng_state",
    "state_bytes",
]
