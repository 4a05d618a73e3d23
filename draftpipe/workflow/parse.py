"""What the workflow computes once when it is read: the verifier it plans against, where the rules read it, how
the stages that prompt it render prompts, whether the report's live check runs; and, in the main process only,
the shard check before planning and the plan printed for a person.

The Snakefile (``rules/common.smk``) calls these once; every function reads the validated config (schema defaults
filled) and imports no ML library.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from draftpipe.core.layout import SHARD_HEADER_CACHE
from draftpipe.formats.chat import template_kwargs
from draftpipe.formats.hidden_states import check_shards_cached
from draftpipe.formats.provenance import quarantine
from draftpipe.formats.verifier import load_verifier_config, resolve_verifier
from draftpipe.workflow.config import ConfigError
from draftpipe.workflow.plan import format_plan, plan

#: where the ``verifier`` rule writes a converted GGUF (the rules read the verifier from here)
CONVERTED_VERIFIER = "results/verifier"


def configured_verifier(config: dict) -> dict:
    """The verifier the workflow plans against (:func:`draftpipe.formats.verifier.resolve_verifier`), or, where
    ``verifier.path`` does not exist here and ``verifier.config_json`` is set, a hub verifier planned against that
    checked-in config (the weights are fetched where the jobs run).

    Raises:
        ConfigError: ``verifier.config_json`` does not exist.
        draftpipe.formats.verifier.VerifierNotFoundError: ``verifier.path`` is neither a local model nor cached.
    """
    config_json = config["verifier"].get("config_json")
    if config_json and not os.path.exists(config["verifier"]["path"]):
        if not os.path.isfile(config_json):
            raise ConfigError(f"verifier.config_json: {config_json} does not exist")
        return {"kind": "hub", "id": config["verifier"]["path"], "config_path": config_json}
    return resolve_verifier(config["verifier"]["path"], field="verifier.path", revision=config["verifier"]["revision"])


def verifier_dir(verifier: dict) -> str:
    """Where the rules read the verifier from: the converted directory for a GGUF, else the user's directory or hub
    id."""
    if verifier["kind"] == "gguf":
        return CONVERTED_VERIFIER
    if verifier["kind"] == "local":
        return str(verifier["path"])
    return verifier["id"]


def rendering(config: dict, chat_template_sha: str | None) -> dict:
    """How the stages that prompt the verifier with eval or benchmark prompts render them (a param of those
    rules): the chat template file's SHA-256, the system prompt and the template's variables."""
    return {
        "chat_template_sha256": chat_template_sha,
        "system_prompt": config["prompts"]["system_prompt"],
        "template_kwargs": template_kwargs(config["completions"]["reasoning"]),
    }


def live_check(config: dict) -> bool:
    """``report.live_check``: ``auto`` (the default) runs the live vLLM check where vLLM is installed."""
    live = config["report"]["live_check"]
    if live == "auto":
        return importlib.util.find_spec("vllm") is not None
    return bool(live)


def quarantine_corrupt_shards(paths: Iterable[str], results: str = "results", out: TextIO = sys.stderr) -> list:
    """Move a truncated or corrupt hidden-state shard (a disk error, a copy cut short) aside before Snakemake plans,
    so that it is rebuilt instead of trained on (:func:`draftpipe.formats.hidden_states.check_shards_cached`: shards
    that passed are remembered by size, mtime and inode); prints one line per shard moved. Returns ``(source,
    destination)`` pairs."""
    bad = check_shards_cached(list(paths), SHARD_HEADER_CACHE)
    reasons = {os.path.abspath(k): v for k, v in bad.items()}
    moved = quarantine(list(bad), results) if bad else []
    for src, dst in moved:
        if src.name.endswith(".safetensors"):
            print(
                f"draftpipe: {src} is corrupt ({reasons[os.path.abspath(src)]}); moved to {dst}; it is rebuilt when a job "
                f"reads it (now: snakemake {src})",
                file=out,
            )
    return moved


def print_plan(config: dict, verifier: dict, derived: dict, fingerprints: dict, out: TextIO = sys.stderr) -> dict:
    """The plan of this run (:func:`draftpipe.workflow.plan.plan`), printed for a person; returns it."""
    if verifier["kind"] == "gguf":
        verifier_config: Any = None
    else:
        verifier_config = load_verifier_config(verifier.get("config_path") or verifier["path"])
    the_plan = plan(config, dict(derived), verifier_config, fingerprints)
    print(format_plan(the_plan), file=out)
    return the_plan
