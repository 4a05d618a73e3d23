"""What identifies the verifier for ``params:`` (by content, so a touch or a copy reruns nothing) and what it is
called in titles."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from draftpipe.core.io import cached_sha256, cached_sha256s
from draftpipe.core.layout import DIGEST_CACHE
from draftpipe.formats.chat import template_hash
from draftpipe.formats.verifier import gguf_metadata

#: Files of a Hugging Face model directory that shape what the verifier generates and how its text is tokenized.
IDENTITY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
#: Suffixes of weight files (top level of the directory).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_dir_template_hash(model_dir: str | Path) -> str | None:
    """:func:`draftpipe.formats.chat.template_hash` of a model directory's chat template: ``chat_template.jinja``, else
    ``chat_template.json``'s or ``tokenizer_config.json``'s ``chat_template`` value (a string, or a list of named
    templates). None when the directory has none. transformers reads them in that order."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return template_hash((d / "chat_template.jinja").read_bytes().decode("utf-8"))
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            value = json.loads((d / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if value:
            return template_hash(value)
    return None


def model_dir_identity(model_dir: str | Path, cache_file: str | Path | None = DIGEST_CACHE) -> dict:
    """Content identity of a Hugging Face model directory: the SHA-256 of each of its :data:`IDENTITY_FILES` and
    weight files (:data:`WEIGHT_SUFFIXES`, the shard index included) and of its chat template.

    Digests come from :func:`draftpipe.core.io.cached_sha256`: free for a hub-cache snapshot (blob names), read once per
    file version otherwise (the cache is read and written once). Returns ``{"files": {name: sha256}, "chat_template_sha256": str | None}``.
    """
    d = Path(model_dir)
    names = [n for n in IDENTITY_FILES if (d / n).is_file()]
    names += sorted(
        p.name
        for p in d.iterdir()
        if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json"))
    )
    return {
        "files": dict(zip(names, cached_sha256s([d / n for n in names], cache_file))),
        "chat_template_sha256": model_dir_template_hash(d),
    }


def verifier_identity(
    resolved: dict, config: dict, cache_file: str | Path | None = DIGEST_CACHE, gguf: dict | None = None
) -> dict:
    """What identifies the verifier, for ``params:`` (a change reruns everything the verifier shapes; a touch, or
    the same bytes copied elsewhere, reruns nothing).

    - GGUF: the file's SHA-256 and the conversion settings (the converted directory is an artifact of its own):
      ``gguf`` (:func:`gguf_conversion`, what the settings resolve to for this file) where given, else the
      configured ``verifier.gguf_head_dim`` and ``verifier.gguf_max_position_embeddings``.
    - local directory: its path and :func:`model_dir_identity` (config, tokenizer, chat template and weights by
      content).
    - hub id: the id and the configured revision and, when the model is in the local hub cache, the snapshot's
      commit and :func:`model_dir_identity` of the snapshot (blob names, nothing read). Pin ``verifier.revision``
      to a commit where the cache may be updated behind the workflow's back.

    Raises:
        OSError: a file of the verifier cannot be read.
    """
    v = config["verifier"]
    if resolved["kind"] == "gguf":
        return {
            "gguf_sha256": cached_sha256(resolved["path"], cache_file),
            "head_dim": (gguf or {}).get("head_dim", v.get("gguf_head_dim")),
            "max_position_embeddings": (gguf or {}).get(
                "max_position_embeddings", v.get("gguf_max_position_embeddings")
            ),
        }
    if resolved["kind"] == "local":
        return {"path": str(resolved["path"]), **model_dir_identity(resolved["path"], cache_file)}
    out = {"hub_id": resolved["id"], "revision": v.get("revision")}
    snapshot = Path(resolved.get("config_path") or "").parent
    if snapshot.parent.name == "snapshots":
        out["commit"] = snapshot.name
        out.update(model_dir_identity(snapshot, cache_file))
    return out


def verifier_name(resolved: dict) -> str:
    """A verifier's name for titles: a GGUF's file stem (``stories260K``), a directory's name, or the hub id."""
    if resolved.get("kind") == "hub":
        return str(resolved["id"])
    p = Path(str(resolved["path"]))
    return p.stem if resolved.get("kind") == "gguf" else p.name


def report_title(config: dict, resolved: dict) -> str:
    """``bench.report.title``, or when null ``<method> draft for <verifier_name> in vLLM`` (``EAGLE-3``, or
    ``DFlash`` with ``draft.method: dflash``)."""
    title = ((config.get("bench") or {}).get("report") or {}).get("title")
    method = "DFlash" if (config.get("draft") or {}).get("method") == "dflash" else "EAGLE-3"
    return title if title else f"{method} draft for {verifier_name(resolved)} in vLLM"


def verifier_hub_id(resolved: dict, config: dict) -> str | None:
    """The verifier's Hugging Face Hub id: ``verifier.hub_id``, else ``verifier.path`` when that is a hub id, else
    None (a GGUF or a local directory named by no Hub id)."""
    hub_id = config["verifier"].get("hub_id")
    if hub_id:
        return str(hub_id)
    return str(resolved["id"]) if resolved.get("kind") == "hub" else None


def published_verifier(resolved: dict, config: dict) -> str:
    """What the draft's ``config.json`` records as its verifier (``speculators_config.verifier.name_or_path``, what
    ``vllm serve <draft dir>`` loads): :func:`verifier_hub_id`, else :func:`verifier_name` (a name, never a path of
    the machine that built the draft)."""
    return verifier_hub_id(resolved, config) or verifier_name(resolved)


def verifier_license(resolved: dict, config: dict) -> str | None:
    """The licence of the draft's model card: ``card.license``, else the verifier's: a GGUF's ``general.license``,
    a directory's (or cached Hub snapshot's) model card ``license`` (the YAML block opening its ``README.md``), else
    None. A card that cannot be read gives None (the draft's card then names no licence)."""
    chosen = (config.get("card") or {}).get("license")
    if chosen:
        return str(chosen)
    if resolved.get("kind") == "gguf":
        value = gguf_metadata(resolved["path"]).get("license")
        return str(value) if value else None
    folder = Path(str(resolved.get("path") or Path(str(resolved.get("config_path") or "")).parent))
    try:
        text = (folder / "README.md").read_text(encoding="utf-8")
        meta = yaml.safe_load(text.split("---", 2)[1]) if text.startswith("---") else None
    except (OSError, UnicodeDecodeError, IndexError, yaml.YAMLError):
        return None
    value = meta.get("license") if isinstance(meta, dict) else None
    return str(value) if isinstance(value, str) and value else None
