"""The prompt sources of a config (``prompts.sources``), checked when the workflow is read: each a local file or a
Hub dataset (:mod:`draftpipe.formats.hub_sources`), its mapping of plain-text records sound, none listed twice."""

from __future__ import annotations

import json
from pathlib import Path

from draftpipe.formats.hub_sources import SHORTCUTS, HubSourceError, check_dataset_id, with_shortcut
from draftpipe.formats.prompt_fields import template_keys
from draftpipe.workflow.errors import ConfigError


def check_sources(sources: list[dict]) -> None:
    """Check ``prompts.sources`` without reading a record: a file exists and is no directory, a Hub dataset names
    ``ORG/NAME`` or a shortcut (it is resolved when the fingerprints are computed), ``field`` and ``template`` are
    not both given and a template parses, and no source is listed twice with the same mapping.

    Raises:
        ConfigError: naming ``prompts.sources[i]`` and the key.
    """
    seen: dict[tuple, int] = {}
    for i, src in enumerate(sources):
        if _is_hub_source(src, f"prompts.sources[{i}]"):
            src = with_shortcut(src)
            if src.get("template") is not None and src.get("field") is not None:
                raise ConfigError(f"prompts.sources[{i}]: give field or template, not both")
            key = json.dumps([src["dataset"], src.get("name"), src.get("split"), src.get("revision")])
            same = seen.setdefault((key, json.dumps([src.get("field"), src.get("template")])), i)
            if same != i:
                raise ConfigError(
                    f"prompts.sources[{i}]: dataset {src['dataset']} is listed twice (also prompts.sources[{same}]) "
                    "with the same config, split, revision and field or template; list each source once"
                )
            continue
        if Path(src["path"]).is_dir():
            raise ConfigError(
                f"prompts.sources[{i}].path: {src['path']} is a directory, not a file: list each of its files as a "
                "source"
            )
        if not Path(src["path"]).is_file():
            raise ConfigError(f"prompts.sources[{i}].path: {src['path']} does not exist")
        if src.get("template") is not None and src.get("field") is not None:
            raise ConfigError(f"prompts.sources[{i}]: give field or template, not both")
        if src.get("template") is not None:
            try:
                template_keys(src["template"])
            except ValueError as exc:
                raise ConfigError(f"prompts.sources[{i}].template: {exc}") from None
        same = seen.setdefault(
            (str(Path(src["path"]).resolve()), json.dumps([src.get("field"), src.get("template")])), i
        )
        if same != i:
            raise ConfigError(
                f"prompts.sources[{i}]: {src['path']} is listed twice (also prompts.sources[{same}]), with the same "
                "field or template; list each source once"
            )


def _is_hub_source(src: dict, field: str) -> bool:
    """Whether a prompt source entry names a Hub dataset (``dataset``) rather than a file (``path``): exactly one of
    them, and ``name``, ``split`` and ``revision`` only with ``dataset``.

    Raises:
        ConfigError: both or neither given, a Hub setting on a file, or a ``dataset`` that is neither ``ORG/NAME``
            nor a shortcut (:data:`draftpipe.formats.hub_sources.SHORTCUTS`)."""
    if (src.get("path") is None) == (src.get("dataset") is None):
        raise ConfigError(
            f"{field}: give path (a local .jsonl, .json or .parquet file) or dataset (a Hugging Face Hub dataset id "
            f"ORG/NAME, or one of {', '.join(sorted(SHORTCUTS))}), one of the two"
        )
    if src.get("path") is not None:
        hub_only = [k for k in ("name", "split", "revision") if src.get(k) is not None]
        if hub_only:
            raise ConfigError(f"{field}.{hub_only[0]}: a setting of a Hub dataset (dataset:), not of a file (path:)")
        return False
    try:
        check_dataset_id(src["dataset"], f"{field}.dataset")
    except HubSourceError as exc:
        raise ConfigError(str(exc)) from None
    return True


def hub_dataset_ids(sources: list[dict]) -> list[str]:
    """The Hub dataset ids (``ORG/NAME``) of ``prompts.sources``, shortcuts named by their id, in order, once each
    (a model card's ``datasets``)."""
    ids = [with_shortcut(src).get("dataset") or src.get("dataset") for src in sources if src.get("dataset")]
    return list(dict.fromkeys(ids))
