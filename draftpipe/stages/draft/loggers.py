"""Training you can watch: speculators' metric loggers (``speculators.train.logger``: TensorBoard, MLflow, Trackio,
Weights & Biases) on the records the draft's trainer logs to ``speculators.metrics`` (per step ``train/<metric>``,
``lr``, ``epoch``; per epoch ``val/<metric>_epoch``), written under the draft's ``logs/`` folder."""

from __future__ import annotations

import importlib.util
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

#: the package each logger of ``draft.loggers`` needs, and where it is installed from
LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "envs/cpu.txt and envs/gpu.txt (installed by envs/setup.sh)"),
    "mlflow": ("mlflow", "bash envs/setup.sh trackers"),
    "trackio": ("trackio", "pip install trackio"),
    "wandb": ("wandb", "pip install wandb"),
}

#: the run's name (TensorBoard: its folder under ``log_dir``; MLflow: its run name): the UTC time it started, the
#: same for every logger of the run
RUN_NAME = "%Y%m%dT%H%M%SZ"


def check_loggers(loggers: list[str] | tuple[str, ...]) -> None:
    """Refuse, before training starts, a logger whose package is not installed.

    Raises:
        ValueError: naming ``draft.loggers``, the logger and how to install its package."""
    for name in loggers:
        if name not in LOGGER_PACKAGES:
            raise ValueError(f"draft.loggers: {name!r} is not one of {', '.join(LOGGER_PACKAGES)}")
        package, how = LOGGER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"draft.loggers: {name} needs the {package!r} package, not installed here ({how})")


def open_loggers(loggers: list[str] | tuple[str, ...], log_dir: str | Path) -> list[logging.Handler]:
    """Attach speculators' handlers for ``loggers`` to ``speculators.metrics`` (its ``setup_metric_logger``), each
    writing a run folder under ``log_dir``; returns them, for :func:`close_loggers`. No logger: nothing attached.

    MLflow logs to a local file store, ``log_dir/mlruns`` (experiment ``draftpipe``), unless ``MLFLOW_TRACKING_URI``
    (and ``MLFLOW_EXPERIMENT_NAME``) are set: MLflow 3 keeps its file store in maintenance mode and refuses it
    unless ``MLFLOW_ALLOW_FILE_STORE`` is true, which is set for that store only. W&B runs offline unless the user
    is logged in (``WANDB_MODE``), speculators' own behaviour.

    Raises:
        ValueError: see :func:`check_loggers`."""
    if not loggers:
        return []
    check_loggers(loggers)
    from speculators.train.logger import setup_metric_logger

    Path(log_dir).mkdir(parents=True, exist_ok=True)
    if "mlflow" in loggers and not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = (Path(log_dir).resolve() / "mlruns").as_uri()
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", "draftpipe")
    setup_metric_logger(list(loggers), datetime.now(UTC).strftime(RUN_NAME), str(log_dir))
    return list(logging.getLogger("speculators.metrics").handlers)


def close_loggers(handlers: list[logging.Handler]) -> None:
    """Flush, close and detach the handlers :func:`open_loggers` attached."""
    metrics = logging.getLogger("speculators.metrics")
    for handler in handlers:
        handler.flush()
        handler.close()
        metrics.removeHandler(handler)
