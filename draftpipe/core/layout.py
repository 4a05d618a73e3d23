"""Where things live, relative to the workflow's working directory: the results tree, its hidden directories and
the caches the workflow keeps between parses. Standard library only; safe at parse time.

Rules name their outputs under :data:`RESULTS` (``rules/*.smk``); the package reaches the same places through this
module instead of path arithmetic.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the directory that holds the ``draftpipe`` package (the repository root of a checkout): a job's subprocesses
#: (torchrun ranks, the live check) put it on ``PYTHONPATH``, and the ML environment ``.venv`` sits beside it
SOURCE_ROOT = Path(__file__).resolve().parents[2]
#: the results directory every rule writes below
RESULTS = "results"
#: content-addressed shard entries of a stage, ``<results>/.store/<stage>/`` (:mod:`draftpipe.runtime.store`)
STORE = ".store"
#: where damaged or corrupt artifacts are moved, ``<results>/.quarantine/<stamp>/`` (never deleted)
QUARANTINE = ".quarantine"
#: the workflow's caches between parses and jobs (Snakemake's own directory keeps them out of ``results/``)
CACHE_DIR = ".snakemake/draftpipe"
#: file digests of the verifier and the prompt sources (:func:`draftpipe.core.io.cached_sha256`)
DIGEST_CACHE = f"{CACHE_DIR}/file_hashes.json"
#: shards whose header passed the parse-time check (:func:`draftpipe.formats.hidden_states.check_shards_cached`)
SHARD_HEADER_CACHE = f"{CACHE_DIR}/shard_headers.json"
#: shards whose values passed the draft job's full check (:func:`draftpipe.runtime.integrity.require_sound_shards`)
SHARD_VALUE_CACHE = f"{CACHE_DIR}/shard_values.json"
#: shards that the draft job's hidden-state gate read, with its result (:func:`draftpipe.stages.draft.state_gate.check_hidden_states`)
SHARD_STATES_CACHE = f"{CACHE_DIR}/shard_states.json"
#: the stat of artifacts the run's damage check found as their manifests record them
#: (:func:`draftpipe.runtime.integrity.damaged_artifacts`)
ARTIFACT_STAT_CACHE = f"{CACHE_DIR}/artifact_stats.json"
#: artifacts the damage check found, until they exist again (:func:`draftpipe.runtime.integrity.unrebuilt_damaged`)
DAMAGE_RECORD = f"{CACHE_DIR}/damaged_artifacts.json"
#: torch.compile's and Triton's caches of the draft job (:mod:`draftpipe.stages.draft.compile_cache`)
COMPILE_CACHE = f"{CACHE_DIR}/torch-compile"


def shard_ids(num_shards: int) -> list[str]:
    """The ids of a stage's training shards, ``00000`` .. ``<num_shards - 1>`` (five digits, the ``{shard}``
    wildcard of every per-shard rule)."""
    return [f"{i:05d}" for i in range(num_shards)]


def results_dir_of(output: str | os.PathLike) -> Path:
    """The results directory of a stage output ``<results>/<stage>/<file>``."""
    return Path(output).parents[1]


def store_dir(output: str | os.PathLike, stage: str) -> Path:
    """The stage store of a shard output ``<results>/<stage>/train_<shard>.<ext>``: ``<results>/.store/<stage>``."""
    return results_dir_of(output) / STORE / stage


def ml_python() -> str:
    """The ML environment's interpreter: ``DRAFTPIPE_ML_PYTHON``, else ``.venv/bin/python`` beside this package."""
    return os.environ.get("DRAFTPIPE_ML_PYTHON") or str(SOURCE_ROOT / ".venv" / "bin" / "python")
