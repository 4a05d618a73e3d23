"""Prompt sets: read sources, normalise to chat records, deduplicate, split train/eval and shard.

A *record* is ``{"id": str, "messages": [{"role": str, "content": str}, ...], "source": str, "line": int}``.
``id`` is the first 16 hex digits of the SHA-256 of the canonical JSON of ``messages``, so it depends on content
only: the same prompt in two files, or on another line, gets the same id. The train/eval split and the shard of a
training prompt are functions of the id alone, so appending prompts to a source never moves an existing prompt to
another split or shard.

Accepted source formats (chosen by file suffix; ``.gz`` is decompressed):

- ``.jsonl``: one JSON object per line;
- ``.json``: a JSON array of objects;
- ``.parquet``: one object per row (read with pandas).

Accepted record shapes (the first key found wins, unless the source names ``field``):

- ``messages``: OpenAI chat, ``[{"role": "user"|"assistant"|"system", "content": str}, ...]``;
- ``conversations``: ShareGPT, ``[{"from": "human"|"gpt"|"system", "value": str}, ...]``;
- ``turns``: MT-bench, a list of user turns; only the first turn is kept (later turns need the verifier's
  answers to the earlier ones);
- ``prompt`` (or ``field``): plain text, taken as one user turn.

Trailing assistant turns are removed: the verifier regenerates the answer (EAGLE-3 data regeneration).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

ROLE_ALIASES = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant",
    "system": "system",
}
SHAPE_KEYS = ("messages", "conversations", "turns", "prompt")


class PromptFormatError(ValueError):
    """A prompt source has a line or record that cannot be read; the message names file and line."""


@dataclass
class PromptStats:
    """Counts of what happened to the records of all sources."""

    read: int = 0
    empty: int = 0
    duplicates: int = 0
    kept: int = 0
    per_source: dict = field(default_factory=dict)


def prompt_id(messages: list[dict]) -> str:
    """Stable content id of a chat prompt: sha256 of its canonical JSON, first 16 hex digits."""
    canon = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _unit_interval(key: str) -> float:
    """Map a string to a uniform float in [0, 1) with SHA-256 (platform- and run-independent)."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:15], 16) / float(16**15)


def is_eval(pid: str, eval_fraction: float, seed: int) -> bool:
    """Whether the prompt with id ``pid`` belongs to the eval split (a deterministic function of id and seed)."""
    return _unit_interval(f"split:{seed}:{pid}") < eval_fraction


def shard_of(pid: str, num_shards: int) -> int:
    """The training shard (0 .. num_shards-1) of the prompt with id ``pid``; independent of every other prompt."""
    return int(hashlib.sha256(f"shard:{pid}".encode("utf-8")).hexdigest()[:15], 16) % num_shards


def _open_text(path: Path) -> io.TextIOBase:
    raw = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline=None)


def _base_suffix(path: Path) -> str:
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def iter_source_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_or_row_number, object)`` for each record of a source file (1-based numbers).

    Raises:
        FileNotFoundError: the file does not exist.
        PromptFormatError: a JSONL line is not valid JSON or not UTF-8 (naming file and line), a JSON file
            is not an array, or the suffix is not one of ``.jsonl``, ``.json``, ``.parquet`` (optionally ``.gz``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt source {path} does not exist")
    suffix = _base_suffix(path)
    if suffix == ".jsonl":
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise PromptFormatError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason})") from exc
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PromptFormatError(
                        f"{path}:{lineno}: malformed JSON line ({exc.msg} at column {exc.colno})"
                    ) from exc
    elif suffix == ".json":
        try:
            with _open_text(path) as fh:
                data = json.load(fh)
        except UnicodeDecodeError as exc:
            raise PromptFormatError(f"{path}: not valid UTF-8 ({exc.reason})") from exc
        except json.JSONDecodeError as exc:
            raise PromptFormatError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg})") from exc
        if not isinstance(data, list):
            raise PromptFormatError(f"{path}: a .json prompt source must be an array of records")
        for i, obj in enumerate(data, start=1):
            yield i, obj
    elif suffix == ".parquet":
        import pandas as pd

        frame = pd.read_parquet(path)
        for i, row in enumerate(frame.to_dict(orient="records"), start=1):
            yield i, {k: _to_python(v) for k, v in row.items()}
    else:
        raise PromptFormatError(f"{path}: unknown prompt source format {suffix!r} (use .jsonl, .json or .parquet)")


def _to_python(value: Any) -> Any:
    """Turn numpy arrays/scalars from a parquet row into plain lists and scalars."""
    if hasattr(value, "tolist"):
        return _to_python(value.tolist())
    if isinstance(value, list):
        return [_to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    return value


def normalise_record(obj: Any, where: str, text_field: str | None = None) -> list[dict]:
    """Turn one source record into a chat prompt ``[{"role", "content"}, ...]`` ending in a user turn.

    Args:
        obj: the parsed record.
        where: ``"file:line"`` for error messages.
        text_field: if given, the key holding plain prompt text (overrides shape detection).

    Returns:
        The messages; an empty list when the prompt is empty or whitespace only (the caller drops it).

    Raises:
        PromptFormatError: naming ``where`` when the record is not an object, has none of the accepted keys,
            or has a malformed message list.
    """
    if not isinstance(obj, dict):
        raise PromptFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    keys = (text_field,) if text_field else SHAPE_KEYS
    key = next((k for k in keys if k in obj), None)
    if key is None:
        wanted = f"{text_field!r}" if text_field else "one of " + ", ".join(repr(k) for k in SHAPE_KEYS)
        raise PromptFormatError(f"{where}: record has none of the keys {wanted} (found {sorted(obj)})")
    value = obj[key]
    if key in ("prompt", text_field) and key not in ("messages", "conversations", "turns"):
        if not isinstance(value, str):
            raise PromptFormatError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
        messages = [{"role": "user", "content": value}]
    elif key == "turns":
        if not isinstance(value, list) or not value or not isinstance(value[0], str):
            raise PromptFormatError(f"{where}: 'turns' must be a non-empty list of strings")
        messages = [{"role": "user", "content": value[0]}]
    else:
        if not isinstance(value, list):
            raise PromptFormatError(f"{where}: {key!r} must be a list of messages")
        messages = []
        for j, msg in enumerate(value):
            if not isinstance(msg, dict):
                raise PromptFormatError(f"{where}: {key}[{j}] must be an object")
            role = msg.get("role", msg.get("from"))
            content = msg.get("content", msg.get("value"))
            if role is None or str(role).lower() not in ROLE_ALIASES:
                raise PromptFormatError(f"{where}: {key}[{j}] has unknown role {role!r}")
            if not isinstance(content, str):
                raise PromptFormatError(f"{where}: {key}[{j}] content must be a string")
            messages.append({"role": ROLE_ALIASES[str(role).lower()], "content": content})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        return []
    return messages


def load_prompts(sources: Iterable[dict]) -> tuple[list[dict], PromptStats]:
    """Read every source, normalise, and drop empty prompts and duplicates (first occurrence wins).

    Args:
        sources: dicts with ``path`` and optional ``field`` (plain-text key).

    Returns:
        ``(records, stats)``; records are sorted by id.

    Raises:
        FileNotFoundError, PromptFormatError: see :func:`iter_source_rows` and :func:`normalise_record`.
    """
    stats = PromptStats()
    seen: dict[str, dict] = {}
    for src in sources:
        path = Path(src["path"])
        counts = Counter()
        for lineno, obj in iter_source_rows(path):
            counts["read"] += 1
            messages = normalise_record(obj, f"{path}:{lineno}", src.get("field"))
            if not messages:
                counts["empty"] += 1
                continue
            pid = prompt_id(messages)
            if pid in seen:
                counts["duplicates"] += 1
                continue
            seen[pid] = {"id": pid, "messages": messages, "source": str(path), "line": lineno}
            counts["kept"] += 1
        stats.per_source[str(path)] = dict(counts)
        stats.read += counts["read"]
        stats.empty += counts["empty"]
        stats.duplicates += counts["duplicates"]
    records = [seen[k] for k in sorted(seen)]
    stats.kept = len(records)
    return records, stats


def split_and_shard(
    records: list[dict], eval_fraction: float, num_shards: int, seed: int
) -> tuple[list[list[dict]], list[dict]]:
    """Split records into ``num_shards`` training shards and one eval list, each sorted by id.

    Raises:
        ValueError: ``num_shards < 1`` or ``eval_fraction`` outside [0, 1).
    """
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError("eval_fraction must be in [0, 1)")
    shards: list[list[dict]] = [[] for _ in range(num_shards)]
    evals: list[dict] = []
    for rec in sorted(records, key=lambda r: r["id"]):
        if is_eval(rec["id"], eval_fraction, seed):
            evals.append(rec)
        else:
            shards[shard_of(rec["id"], num_shards)].append(rec)
    return shards, evals
