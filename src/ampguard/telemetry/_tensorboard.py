"""TensorBoard sink: scalars through the ``tensorboard`` package's own event-file writer."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["TensorBoardSink", "require_tensorboard"]

_INSTALL = "pip install 'ampguard[tensorboard]'"


def require_tensorboard() -> None:
    """Raise ``ImportError`` with the install command when ``tensorboard`` is missing."""
    try:
        import tensorboard.summary.writer.event_file_writer  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"Telemetry(tensorboard=True) needs the tensorboard package: {_INSTALL}"
        ) from exc


def _tag(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name) or "_"


class TensorBoardSink:
    """Writes ``ampguard/*`` scalars (scale, skip rate, loss, grad norms, per-layer norms).

    Events are written only at telemetry flushes, so TensorBoard costs nothing between them.
    """

    def __init__(self, logdir: str | os.PathLike, layers: Sequence[str]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2 = event_pb2
        self._summary_pb2 = summary_pb2
        self._writer = EventFileWriter(str(logdir), max_queue_size=1000, flush_secs=3600)
        self._layer_tags = [f"ampguard/layer_grad_norm/{_tag(n)}" for n in layers]

    def _scalars(self, step: int, wall: float, values: dict[str, float | None]) -> None:
        summary = self._summary_pb2.Summary(
            value=[
                self._summary_pb2.Summary.Value(tag=tag, simple_value=float(v))
                for tag, v in values.items()
                if v is not None
            ]
        )
        self._writer.add_event(self._event_pb2.Event(wall_time=wall, step=step, summary=summary))

    def write(self, records: Sequence[dict[str, Any]], skip_rate: Sequence[float]) -> None:
        """Write one flush worth of step records; ``skip_rate[i]`` is the running skip rate."""
        wall = time.time()
        for rec, rate in zip(records, skip_rate, strict=True):
            values = {
                "ampguard/scale": rec.get("scale"),
                "ampguard/skip_rate": rate,
                "ampguard/loss": rec.get("loss"),
                "ampguard/grad_norm": rec.get("grad_norm"),
            }
            layers = rec.get("layers")
            if layers is not None:
                values.update(zip(self._layer_tags, layers["grad_norm"], strict=True))
            self._scalars(int(rec["step"]), wall, values)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
