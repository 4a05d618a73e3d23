"""The configuration reference of the documentation, generated from ``config.schema.yaml`` (the one source of every
key's type, default and meaning) when the site builds (``docs/hooks/generated.py``): never written by hand."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import yaml

from draftpipe.workflow.config import SCHEMA


def load_schema(path: str | Path = SCHEMA) -> dict:
    """The JSON schema the workflow validates ``config.yaml`` with (Snakemake's ``validate``), as a dict."""
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))


def schema_keys(schema: dict, prefix: str = "") -> Iterator[tuple[str, dict]]:
    """Every key the schema describes, depth first in the schema's order, as ``(dotted key, its schema)``: a list
    of objects adds ``[]`` to its key (``prompts.sources[].path``); an object's own entry comes before its keys."""
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}{name}"
        yield key, sub
        if "properties" in sub:
            yield from schema_keys(sub, key + ".")
        items = sub.get("items")
        if isinstance(items, dict) and "properties" in items:
            yield from schema_keys(items, key + "[].")


def _types(sub: dict) -> list[str]:
    if "oneOf" in sub or "anyOf" in sub:
        return [t for alt in sub.get("oneOf", sub.get("anyOf")) for t in _types(alt)]
    kind = sub.get("type", "any")
    kinds = kind if isinstance(kind, list) else [kind]
    if "array" in kinds and isinstance(sub.get("items"), dict) and "properties" not in sub["items"]:
        inner = " \\| ".join(_types(sub["items"]))
        kinds = [f"array of {inner}" if k == "array" else k for k in kinds]
    return kinds


def type_text(sub: dict) -> str:
    """A key's type as the reference prints it: the JSON types (``integer \\| null``), then the allowed values
    (``one of``) and bounds (``>= 1``) the schema sets."""
    parts = [" \\| ".join(_types(sub))]
    if "enum" in sub:
        parts.append("one of " + ", ".join(f"`{json.dumps(v)}`" for v in sub["enum"]))
    for word, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if word in sub:
            parts.append(f"{sign} {sub[word]}")
    if "pattern" in sub:
        parts.append(f"pattern `{sub['pattern']}`")
    return "; ".join(parts)


def default_text(sub: dict, required: bool) -> str:
    """A key's default as YAML flow text in a code span, ``required`` for a key the config must give, else empty."""
    if "default" in sub:
        text = yaml.safe_dump(sub["default"], default_flow_style=True, width=1000).strip()
        return f"`{text.removesuffix('...').strip()}`"
    return "required" if required else ""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render_config_reference(schema: dict | None = None) -> str:
    """The reference page (Markdown): a section per top-level key of ``config.yaml``, a table row per key below it
    (key, type, default, description), every key of :func:`schema_keys`."""
    schema = schema or load_schema()
    lines = [
        "# Configuration reference",
        "",
        "Every key of `config.yaml` (and of a `--configfile` file or `--config` override), generated from",
        "`draftpipe/workflow/config.schema.yaml` when this site is built. The workflow validates the config",
        "against the same schema when it is read and fills in the defaults below; "
        "`draftpipe-config` prints the result.",
        "Whether a change reruns something: a key that shapes an artifact reruns the rule that makes it and",
        "everything built from it (a dry run, `snakemake -n`, names each and why); keys whose description says",
        "*recomputes nothing* or *shapes nothing* rerun nothing (see [What reruns](../reruns.md)).",
    ]
    top = schema.get("properties", {})
    required_of = {"": set(schema.get("required", []))}
    for key, sub in schema_keys(schema):
        parent = key.rpartition(".")[0]
        if "properties" in sub:
            required_of[key] = set(sub.get("required", []))
        items = sub.get("items")
        if isinstance(items, dict) and "properties" in items:
            required_of[key + "[]"] = set(items.get("required", []))
        if key in top:
            lines += ["", f"## `{key}`", ""]
            if sub.get("description"):
                lines += [_cell(sub["description"]), ""]
            lines += ["| Key | Type | Default | Description |", "|---|---|---|---|"]
        required = key.rpartition(".")[2] in required_of.get(parent, set())
        row = (f"`{key}`", type_text(sub), default_text(sub, required), _cell(sub.get("description", "")))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
