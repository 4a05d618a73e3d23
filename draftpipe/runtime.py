"""Small helpers for the scripts that Snakemake rules run."""

from __future__ import annotations

import logging
import os
import sys


def redirect_output(log_path: str | None) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so child processes such as vLLM's
    workers too) to the rule's log file, and configure ``logging`` at INFO level."""
    if log_path:
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)


def limit_threads(threads: int) -> None:
    """Use ``threads`` intra-op threads in torch (Snakemake's ``threads:``), at least 1."""
    import torch

    torch.set_num_threads(max(1, int(threads)))


def engine_parallelism(gpus: int) -> dict:
    """vLLM engine arguments for a job holding ``gpus`` devices: tensor parallel over all of them."""
    return {"tensor_parallel_size": int(gpus)} if int(gpus) > 1 else {}
