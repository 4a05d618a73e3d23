"""Content fingerprints of the prompt set's parts (training shards, eval split), computed when the workflow is parsed.

Snakemake decides what to rerun before any job runs, from mtimes, params and code; it has no "rerun the consumers
only if the output changed" (ninja's ``restat``). A single job writing every shard would, once a source changed,
make Snakemake plan every shard's completions, hidden states and so on. So each part is its own job whose only
param that matters is the part's fingerprint, computed here at parse time with the same functions the job runs
(:func:`draftpipe.formats.prompts.load_prompts`, :func:`draftpipe.formats.prompts.split_and_shard`). Appending or editing prompts
changes the fingerprint of the parts they fall in, and only those parts, and what is built from them, rerun.

The fingerprint covers what the consumers read of a record, its ``id`` and ``messages``; the ``source`` and
``line`` fields (provenance of the record) are left out, so inserting a line above a prompt does not invalidate it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable

from draftpipe.formats.prompts import generation_points, load_prompts, split_and_shard


def records_digest(records: Iterable[dict]) -> str:
    """SHA-256 (hex) of the ``id`` and ``messages`` of ``records`` in order.

    Args:
        records: prompt records as written by the `prompt_set` stage (``id``, ``messages``, ...).

    Returns:
        64-character hex digest; an empty shard has the digest of the empty string.
    """
    h = hashlib.sha256()
    for rec in records:
        h.update(json.dumps([rec["id"], rec["messages"]], ensure_ascii=False, sort_keys=True).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def _parts(
    sources: list[dict], eval_fraction: float, num_shards: int, split_seed: int, system_prompt: str | None = None
):
    """``(training shards, eval records, stats)``: what the `prompt_shard` jobs write (read, normalise, split)."""
    records, stats = load_prompts(sources, system_prompt)
    return (*split_and_shard(records, eval_fraction, num_shards, split_seed), stats)


def prompt_fingerprints(
    sources: list[dict], eval_fraction: float, num_shards: int, split_seed: int, system_prompt: str | None = None
) -> dict:
    """Fingerprints of every training shard and of the eval split that `prompt_set` will write.

    Args:
        sources: ``prompts.sources`` of the config (``path``, optional ``field``).
        eval_fraction, num_shards, split_seed: the split settings of ``prompts:``.
        system_prompt: ``prompts.system_prompt`` (part of every record without a system turn, so of the digests).

    Returns:
        ``{"train": [digest per shard], "eval": digest, "prompts": number of records kept, "train_prompts":
        number kept for training, "train_answers": {answers: training records} (the answers the verifier writes
        in a conversation with ``completions.turns: all``, :func:`draftpipe.formats.prompts.generation_points`),
        "warnings": the loader's warnings (text a mapping leaves out), "per_source": what each source gave
        (:class:`draftpipe.formats.prompts.PromptStats`)}``.

    Raises:
        FileNotFoundError, draftpipe.formats.prompts.PromptFormatError: a source is missing or malformed (the message names
            the file and line), exactly as the `prompt_set` job would fail.
        NoTrainingPromptsError (a ValueError): the training shards would hold no prompt; the message gives the
            counts of what was read and dropped.
    """
    shards, evals, stats = _parts(sources, eval_fraction, num_shards, split_seed, system_prompt)
    train = sum(map(len, shards))
    if train == 0:
        first = f" (the first at {stats.empty_at[0]})" if stats.empty_at else ""
        raise NoTrainingPromptsError(
            f"prompts.sources: no prompt to train on: {stats.read} record(s) read from {len(sources)} source(s), {stats.empty} without "
            f"a prompt to answer{first}, {stats.duplicates} duplicate(s), {stats.kept} kept, {len(evals)} of them "
            "in the eval split (prompts.eval_fraction); a record needs a user turn, or text under its field"
        )
    return {
        "train": [records_digest(s) for s in shards],
        "eval": records_digest(evals),
        "prompts": train + len(evals),
        "train_prompts": train,
        "train_answers": dict(Counter(len(generation_points(r["messages"])) for s in shards for r in s)),
        "warnings": stats.warnings,
        "per_source": stats.per_source,
    }


class NoTrainingPromptsError(ValueError):
    """The prompt sources leave no prompt for the training shards."""


class StaleFingerprintError(RuntimeError):
    """The sources changed between planning and running a prompt-set job."""


def prompt_part(
    sources: list[dict],
    eval_fraction: float,
    num_shards: int,
    split_seed: int,
    part: str,
    fingerprint: str,
    system_prompt: str | None = None,
) -> list[dict]:
    """The records of one part of the prompt set, checked against the fingerprint the job was planned with.

    Args:
        sources, eval_fraction, num_shards, split_seed, system_prompt: as in :func:`prompt_fingerprints`.
        part: ``"train_00003"`` (training shard 3) or ``"eval"``.
        fingerprint: the part's :func:`records_digest` at parse time.

    Returns:
        the part's records (``id``, ``messages``, ``tools`` when given, ``source``, ``line``), sorted by id.

    Raises:
        ValueError: an unknown part name.
        StaleFingerprintError: the records no longer match ``fingerprint`` (a source changed after the workflow
            was parsed); rerun Snakemake.
    """
    shards, evals, _ = _parts(sources, eval_fraction, num_shards, split_seed, system_prompt)
    if part == "eval":
        out = evals
    elif part.startswith("train_") and part[6:].isdigit() and int(part[6:]) < num_shards:
        out = shards[int(part[6:])]
    else:
        raise ValueError(f"unknown prompt-set part {part!r} (train_NNNNN below {num_shards:05d}, or eval)")
    found = records_digest(out)
    if found != fingerprint:
        raise StaleFingerprintError(
            f"{part}: the prompt sources changed after the workflow was planned "
            f"(fingerprint {found[:16]} != {fingerprint[:16]}); run snakemake again"
        )
    return out
