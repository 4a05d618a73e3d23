"""Checks of config.yaml that need more than its JSON schema, run when the Snakefile is parsed (before any job).

The schema (``draftpipe/config.schema.yaml``) catches wrong keys and types; :func:`check_config` catches values
that only make sense against the verifier and the file system: missing prompt sources, a verifier that does not
exist, aux layer ids outside the verifier's depth, a draft vocabulary larger than the verifier's.
:func:`validate_config` runs the schema itself with messages that name the key (``section.key: ...``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from draftpipe.hidden_states import resolve_aux_layer_ids


class ConfigError(ValueError):
    """A config value is wrong; the message names the key (``section.key``)."""


SCHEMA = Path(__file__).with_name("config.schema.yaml")


def _field(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "config"


def _schema_message(error) -> str:
    """``field: what is wrong`` for one ``jsonschema`` error; unknown and missing keys are named as fields."""
    where = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = sorted(error.schema.get("properties", {}))
        extra = sorted(k for k in error.instance if k not in known)
        return f"{_field(where + extra[:1])}: unknown key (known keys: {', '.join(known)})"
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        return f"{_field(where + missing[:1])}: missing (a required key)"
    return f"{_field(where)}: {error.message}"


def validate_config(config: dict, schema: str | Path = SCHEMA) -> None:
    """Check ``config`` against the JSON schema (without filling defaults), naming the key of the first error.

    Errors are ordered by key path, so the same config always reports the same error.

    Args:
        config: the parsed config.yaml.
        schema: the schema file (default: ``draftpipe/config.schema.yaml``).

    Raises:
        ConfigError: ``section.key: <what is wrong>``, e.g. ``completions.too_long: 'chop' is not one of ['drop',
            'truncate', 'error']`` or ``completions.temprature: unknown key (known keys: ...)``.
    """
    import jsonschema
    import yaml

    spec = yaml.safe_load(Path(schema).read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(spec)(spec)
    errors = sorted(validator.iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        raise ConfigError(_schema_message(errors[0]))


def gguf_shape(path: str) -> dict:
    """Read ``block_count``, ``embedding_length`` and the vocabulary size from a GGUF header (``gguf.GGUFReader``)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    fld = reader.fields[f"{arch}.block_count"]
    num_layers = int(fld.parts[fld.data[0]][0])
    tokens = reader.fields["tokenizer.ggml.tokens"]
    emb = reader.fields[f"{arch}.embedding_length"]
    return {"num_hidden_layers": num_layers, "vocab_size": len(tokens.data), "hidden_size": int(emb.parts[emb.data[0]][0])}


def verifier_shape(resolved: dict) -> dict:
    """``num_hidden_layers`` and ``vocab_size`` of a resolved verifier (see ``verifier.resolve_verifier``)."""
    if resolved["kind"] == "gguf":
        return gguf_shape(resolved["path"])
    cfg_path = resolved.get("config_path") or str(Path(resolved["path"]) / "config.json")
    cfg = json.loads(Path(cfg_path).read_text())
    cfg = cfg.get("text_config", cfg)
    return {"num_hidden_layers": int(cfg["num_hidden_layers"]), "vocab_size": int(cfg["vocab_size"]),
            "hidden_size": int(cfg["hidden_size"])}


def verifier_identity(resolved: dict, config: dict) -> dict:
    """What identifies the verifier's weights, for ``params:`` (a change reruns everything the verifier shapes).

    GGUF: the file's SHA-256 and the conversion settings; local directory: its path (its ``config.json`` is also an
    input file); hub id: id and revision.
    """
    v = config["verifier"]
    if resolved["kind"] == "gguf":
        h = hashlib.sha256(Path(resolved["path"]).read_bytes()).hexdigest()
        return {"gguf_sha256": h, "head_dim": v.get("gguf_head_dim"),
                "max_position_embeddings": v.get("gguf_max_position_embeddings")}
    if resolved["kind"] == "local":
        return {"path": str(resolved["path"])}
    return {"hub_id": resolved["id"], "revision": v.get("revision")}


def check_config(config: dict, resolved: dict) -> dict[str, Any]:
    """Check values against the verifier and the file system; return derived values (aux ids, shape).

    Checked: every ``prompts.sources[i].path`` and ``bench.prompt_sets[i].path`` is a file,
    ``hidden_states.aux_layer_ids`` fit the verifier's depth, ``vocab.draft_vocab_size`` does not exceed the
    verifier's vocabulary.

    Raises:
        ConfigError: naming the key of the first wrong value.
    """
    for i, src in enumerate(config["prompts"]["sources"]):
        if not Path(src["path"]).is_file():
            raise ConfigError(f"prompts.sources[{i}].path: {src['path']} does not exist")
    for i, src in enumerate((config.get("bench") or {}).get("prompt_sets") or []):
        if not Path(src["path"]).is_file():
            raise ConfigError(f"bench.prompt_sets[{i}].path: {src['path']} does not exist")
    shape = verifier_shape(resolved)
    field = "hidden_states.aux_layer_ids"
    try:
        aux = resolve_aux_layer_ids(config["hidden_states"].get("aux_layer_ids"), shape["num_hidden_layers"], field)
    except ValueError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(f"{field}: ") else f"{field}: {msg}") from exc
    vd = config["vocab"].get("draft_vocab_size") or shape["vocab_size"]
    if vd > shape["vocab_size"]:
        raise ConfigError(f"vocab.draft_vocab_size: {vd} exceeds the verifier's vocabulary of {shape['vocab_size']}")
    return {"aux_layer_ids": aux, "draft_vocab_size": vd, **shape}
