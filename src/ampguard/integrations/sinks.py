"""Optional W&B and MLflow sinks for :class:`ampguard.Telemetry` (TensorBoard is built in).

>>> tel = ag.Telemetry("runs/exp1", sinks=[WandbSink(project="my-project")])
>>> tel = ag.Telemetry("runs/exp1", sinks=[MlflowSink(experiment="my-exp")])

A sink receives the step records at every telemetry flush (never between flushes, so it adds no
per-step cost) and logs ``ampguard/scale``, ``ampguard/skip_rate``, ``ampguard/loss``,
``ampguard/grad_norm``, ``ampguard/applied`` and per-layer ``ampguard/layer_grad_norm/<layer>``
against the optimizer step. W&B keeps its own step counter for the user's metrics, so ampguard's
metrics use ``ampguard/step`` as their x-axis (``define_metric``) and never move it. Both work
offline: ``WANDB_MODE=offline`` / ``mode="offline"`` writes a local run; MLflow logs to whatever
``tracking_uri`` says. A local folder works without a server: MLflow 3 refuses its file store
unless ``MLFLOW_ALLOW_FILE_STORE=true``, so the sink sets it while it opens its own store (a
``tracking_uri`` that is a path or a ``file:`` URI) and only then; a value you set yourself wins.
(``mlflow-skinny``, what ``[mlflow]`` installs, has no SQLAlchemy, so ``sqlite:`` stores need the
full ``mlflow``.)

Each sink imports its package when constructed and raises ``ImportError`` naming the extra
(``pip install "ampguard[wandb]"`` / ``"ampguard[mlflow]"``) when it is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ampguard.integrations._extras import require

__all__ = ["WandbSink", "MlflowSink", "step_metrics"]

_PREFIX = "ampguard/"
_MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call


def _tag(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name) or "_"


def step_metrics(
    record: dict[str, Any], skip_rate: float, layers: Sequence[str]
) -> dict[str, float]:
    """The finite scalar metrics of one step record, keyed ``ampguard/...``."""
    values: dict[str, Any] = {
        "scale": record.get("scale"),
        "skip_rate": skip_rate,
        "loss": record.get("loss"),
        "grad_norm": record.get("grad_norm"),
        "applied": float(bool(record.get("applied", True))),
    }
    per_layer = (record.get("layers") or {}).get("grad_norm") or []
    for name, value in zip(layers, per_layer, strict=False):
        values[f"layer_grad_norm/{_tag(name)}"] = value
    return {_PREFIX + k: float(v) for k, v in values.items() if v is not None}


def wandb_init_kwargs(run_dir: str | os.PathLike, init_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``wandb.init``'s arguments for a new run: ``dir=<run_dir>`` unless the caller chose one
    (``dir=`` in ``init_kwargs``, or the ``WANDB_DIR`` environment variable, which is kept)."""
    if "dir" in init_kwargs or os.environ.get("WANDB_DIR"):
        return dict(init_kwargs)
    return {"dir": str(run_dir), **init_kwargs}


class WandbSink:
    """Logs ampguard's step records to a W&B run.

    ``run``: an existing ``wandb`` run (left open on close), else ``wandb.run`` when one is
    active, else a new run from ``wandb.init(dir=<run_dir>, **init_kwargs)`` (finished on close;
    ``WANDB_DIR`` in the environment, or ``dir=``, wins over ``<run_dir>``).
    """

    def __init__(self, run: Any = None, **init_kwargs: Any) -> None:
        self._wandb = require("wandb", "WandbSink")
        self._given = run
        self._init_kwargs = init_kwargs
        self.run: Any = None
        self._owned = False
        self._layers: list[str] = []

    def start(self, run_dir: str | os.PathLike, layers: Sequence[str]) -> None:
        self._layers = list(layers)
        run = self._given if self._given is not None else self._wandb.run
        if run is None:
            run = self._wandb.init(**wandb_init_kwargs(run_dir, self._init_kwargs))
            self._owned = True
        run.define_metric(_PREFIX + "step")
        run.define_metric(_PREFIX + "*", step_metric=_PREFIX + "step")
        self.run = run

    def write(self, records: Sequence[dict[str, Any]], skip_rate: Sequence[float]) -> None:
        for rec, rate in zip(records, skip_rate, strict=True):
            row = step_metrics(rec, rate, self._layers)
            row[_PREFIX + "step"] = int(rec["step"])
            self.run.log(row)

    def close(self) -> None:
        if self._owned and self.run is not None:
            self.run.finish()
        self.run = None


class MlflowSink:
    """Logs ampguard's step records to an MLflow run (one ``log_batch`` per flush).

    ``run_id``: log into this run; else the active run (``mlflow.active_run()``); else a new run
    in ``experiment`` (default "ampguard"), ended on close. ``tracking_uri``: where to log
    (default: MLflow's own setting, ``mlflow.set_tracking_uri`` or ``MLFLOW_TRACKING_URI``;
    where neither is set and MLflow's default is a ``sqlite:`` store that cannot open without
    SQLAlchemy, as with the ``[mlflow]`` extra's mlflow-skinny, the folder ``./mlruns``); a
    local folder (a path, ``os.PathLike`` or ``file:`` URI, given or from the environment) is
    opened with ``MLFLOW_ALLOW_FILE_STORE=true`` set for the moment the store is made (MLflow 3
    refuses file stores otherwise), unless that variable is already set. ``tracking_uri`` (the
    attribute) is the store in use.
    """

    def __init__(
        self,
        run_id: str | None = None,
        *,
        experiment: str = "ampguard",
        tracking_uri: str | os.PathLike | None = None,
    ) -> None:
        self._mlflow = require("mlflow", "MlflowSink")
        from mlflow.tracking import MlflowClient

        uri = os.fspath(tracking_uri) if isinstance(tracking_uri, os.PathLike) else tracking_uri
        uri = _resolve_uri(self._mlflow, uri)
        self.tracking_uri = uri
        with _file_store_allowed(uri):
            self._client = MlflowClient(tracking_uri=uri)
        self._given = run_id
        self._experiment = experiment
        self.run_id: str | None = None
        self._owned = False
        self._layers: list[str] = []

    def start(self, run_dir: str | os.PathLike, layers: Sequence[str]) -> None:
        self._layers = list(layers)
        active = self._mlflow.active_run()
        run_id = self._given or (active.info.run_id if active is not None else None)
        if run_id is None:
            exp = self._client.get_experiment_by_name(self._experiment)
            exp_id = (
                exp.experiment_id
                if exp is not None
                else self._client.create_experiment(self._experiment)
            )
            run_id = self._client.create_run(
                exp_id, tags={"ampguard.run_dir": str(run_dir)}
            ).info.run_id
            self._owned = True
        self.run_id = run_id

    def write(self, records: Sequence[dict[str, Any]], skip_rate: Sequence[float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(key, value, now, int(rec["step"]))
            for rec, rate in zip(records, skip_rate, strict=True)
            for key, value in step_metrics(rec, rate, self._layers).items()
        ]
        if self.run_id is None:
            raise RuntimeError("MlflowSink.write before start (no MLflow run to log into)")
        for start in range(0, len(metrics), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start : start + _MLFLOW_BATCH])

    def close(self) -> None:
        if self._owned and self.run_id is not None:
            self._client.set_terminated(self.run_id)
        self.run_id = None


def _resolve_uri(mlflow: Any, given: str | None) -> str:
    """The store the sink opens: ``given``; else MLflow's setting; else (MLflow's default is a
    ``sqlite:`` store and SQLAlchemy is missing: mlflow-skinny) ``./mlruns`` as a ``file:``
    URI, the folder MLflow used by default before 3.0."""
    if given is not None:
        return given
    uri = str(mlflow.get_tracking_uri())
    user_set = bool(os.environ.get("MLFLOW_TRACKING_URI")) or _set_in_code()
    if user_set or not uri.startswith("sqlite:") or importlib.util.find_spec("sqlalchemy"):
        return uri
    return Path(os.path.abspath("mlruns")).as_uri()


def _set_in_code() -> bool:
    """``mlflow.set_tracking_uri(...)`` was called (MLflow's own check; False where absent)."""
    try:
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set
    except ImportError:
        return False
    return bool(is_tracking_uri_set())


def is_local_store(uri: str | None) -> bool:
    """True when an MLflow ``tracking_uri`` names a local folder (a path or a ``file:`` URI)."""
    if not isinstance(uri, str) or not uri:
        return False
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # "C:\\runs": a drive letter


@contextlib.contextmanager
def _file_store_allowed(uri: str | None) -> Iterator[None]:
    """``MLFLOW_ALLOW_FILE_STORE=true`` while the sink opens its own local store, unless set."""
    name = "MLFLOW_ALLOW_FILE_STORE"
    if not is_local_store(uri) or name in os.environ:
        yield
        return
    os.environ[name] = "true"
    try:
        yield
    finally:
        os.environ.pop(name, None)
