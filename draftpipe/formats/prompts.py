"""Prompt sets: read sources, normalise to chat records, deduplicate, split train/eval and shard.

A *record* is ``{"id": str, "messages": [{"role": str, "content": str}, ...], "source": str, "line": int}``.
``id`` is the first 16 hex digits of the SHA-256 of the canonical JSON of ``messages``, so it depends on content
only: the same prompt in two files, or on another line, gets the same id. The train/eval split and the shard of a
training prompt are functions of the id alone, so appending prompts to a source never moves an existing prompt to
another split or shard.

Accepted source formats (chosen by file suffix; ``.gz`` is decompressed):

- ``.jsonl``: one JSON object per line (blank lines are skipped, a UTF-8 byte-order mark is ignored);
- ``.json``: a JSON array of objects;
- ``.parquet``: one object per row (read with pandas).

Accepted record shapes (the first key found wins, unless the source names ``field``):

- ``messages``: OpenAI chat, ``[{"role": "user"|"assistant"|"system"|"tool", "content": str}, ...]``; ``content``
  may also be a list of text parts ``[{"type": "text", "text": str}, ...]``, which are joined; an assistant turn's
  ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``, its ``content`` may then be null)
  and a tool turn's ``tool_call_id`` and ``name`` are kept; the record's ``tools`` (tool definitions) are kept as
  the record's ``tools``;
- ``conversations``: ShareGPT, ``[{"from": "human"|"gpt"|"system"|"observation"|"function_call", "value": str},
  ...]``; ``function_call`` (a JSON ``{"name", "arguments"}``) becomes an assistant turn with that tool call,
  ``observation`` a tool turn; a ``tools`` key (a list, or its JSON text) becomes the record's ``tools``;
- ``turns``: MT-bench, a list of user turns; only the first turn is kept (later turns need the verifier's
  answers to the earlier ones);
- ``prompt`` (or ``field``): plain text, taken as one user turn.

Trailing assistant turns are removed: the verifier regenerates the answer (EAGLE-3 data regeneration). Earlier
turns are kept whole: the completions stage regenerates every assistant turn on the verifier's own history
(``completions.turns: all``) and keeps the source's tool-call turns and tool results as context. A conversation
may end in a user or a tool turn. ``prompts.system_prompt`` is put first in every record without a system turn.

What is an error and what is dropped. The loader is lenient on data and strict on structure:

- *dropped and counted* (``PromptStats.empty``, with the first locations in ``PromptStats.empty_at``): a record
  whose structure is valid but that holds no prompt to answer: an empty or whitespace-only prompt, an empty
  ``messages``/``conversations``/``turns`` list, or a conversation with no user turn left after the trailing
  assistant turns are removed;
- *dropped and counted* (``PromptStats.duplicates``): a prompt whose content id was already kept (first occurrence
  wins, across all sources);
- *errors* (:class:`PromptFormatError`, the message starts with ``file:line:``, or ``file: row N:`` for parquet):
  a line that is not JSON or not UTF-8, a record that is not an object, a record with none of the accepted keys,
  a prompt or message of the wrong type, an unknown role, a truncated or corrupt ``.gz`` file, a source with no
  records at all, an unknown suffix, and an explicit ``id`` field used twice in one source for different prompts.

Explicit ``id`` fields in a source are not the record id (ids are content hashes), but they are checked: within one
source, the same ``id`` on two different prompts is an error naming both lines (the source is inconsistent); the
same ``id`` on the same prompt is an ordinary duplicate. Different sources may reuse ids (datasets number their
records alike).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftpipe.core.io import MAX_JSON_DEPTH, JSONLimitError, json_depth, load_json, reject_duplicate_keys

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",  # OpenAI's name for the system turn of its newer models
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
    "ipython": "tool",
    "function_call": "assistant",
}
SHAPE_KEYS = ("messages", "conversations", "turns", "prompt")
CHAT_SHAPES = SHAPE_KEYS[:3]  # the shapes that are conversations, not plain text
SUFFIXES = (".jsonl", ".json", ".parquet")
#: how many locations of dropped empty prompts :class:`PromptStats` keeps
MAX_EMPTY_AT = 10

_WS = re.compile(r"[ \t\n\r]*")


class PromptFormatError(ValueError):
    """A prompt source has a line or record that cannot be read; the message names file and line."""


@dataclass
class PromptStats:
    """Counts of what happened to the records of all sources.

    ``read``: records read; ``empty``: records dropped because they hold no prompt (see the module docstring);
    ``duplicates``: records dropped because their content id was already kept; ``kept``: records returned;
    ``empty_at``: ``file:line`` of the first :data:`MAX_EMPTY_AT` empty records; ``per_source``: the counts of
    each source, keyed by its path (``path (prompts.sources[i])`` for a file listed more than once), with
    ``ignored_text``, ``{key: records}``, for text a plain-text record holds outside its prompt; ``warnings``: one
    line for each such key, saying how to keep or silence it.
    """

    read: int = 0
    empty: int = 0
    duplicates: int = 0
    kept: int = 0
    empty_at: list = field(default_factory=list)
    per_source: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)


def prompt_id(messages: list[dict], tools: list | None = None) -> str:
    """Stable content id of a chat prompt: sha256 of the canonical JSON of its messages (and of its tool
    definitions when it has any), first 16 hex digits."""
    doc = {"messages": messages, "tools": tools} if tools else messages
    canon = json.dumps(doc, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def _unit_interval(key: str) -> float:
    """Map a string to a uniform float in [0, 1) with SHA-256 (platform- and run-independent)."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:15], 16) / float(16**15)


def is_eval(pid: str, eval_fraction: float, seed: int) -> bool:
    """Whether the prompt with id ``pid`` belongs to the eval split (a deterministic function of id and seed)."""
    return _unit_interval(f"split:{seed}:{pid}") < eval_fraction


def shard_of(pid: str, num_shards: int) -> int:
    """The training shard (0 .. num_shards-1) of the prompt with id ``pid``; independent of every other prompt."""
    return int(hashlib.sha256(f"shard:{pid}".encode()).hexdigest()[:15], 16) % num_shards


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (``object``, ``array``, ``string``, ``number``, ``boolean``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    return type(value).__name__


def _base_suffix(path: Path) -> str:
    return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def _gzip_error(path: Path, lineno: int | None, exc: BaseException) -> PromptFormatError:
    where = f"{path}:{lineno}" if lineno is not None else str(path)
    what = "truncated" if isinstance(exc, EOFError) else "corrupt"
    return PromptFormatError(f"{where}: gzip file is {what} ({exc})")


def _read_bytes(path: Path) -> bytes:
    """The bytes of a source, decompressed when it ends in ``.gz``; gzip errors become :class:`PromptFormatError`."""
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as fh:
            return fh.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise _gzip_error(path, None, exc) from exc


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    lineno = 0
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
        lines = iter(fh)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                raise _gzip_error(path, lineno + 1, exc) from exc
            lineno += 1
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PromptFormatError(
                    f"{path}:{lineno}: not valid UTF-8 at byte {exc.start + 1} of the line ({exc.reason})"
                ) from exc
            if not line.strip():
                continue
            yield lineno, _parse_line(path, lineno, line)


def _parse_line(path: Path, lineno: int, line: str) -> Any:
    """One JSON Lines record (:func:`draftpipe.core.io.load_json`: bounded depth, no repeated key), with the error naming
    the file and line, and what the bytes most likely are when they are not UTF-8 JSON Lines."""
    if "\x00" in line:
        raise PromptFormatError(
            f"{path}:{lineno}: NUL characters in the line: UTF-16 or UTF-32 text? prompt sources are UTF-8"
        )
    body = line.rstrip("\r\n")  # an error at the line end is at its last column, not on "line 2"
    try:
        obj = load_json(body, unique_keys=True)
    except JSONLimitError as exc:
        raise PromptFormatError(f"{path}:{lineno}: {exc}") from None
    except json.JSONDecodeError as exc:
        if "\r" in body:
            raise PromptFormatError(
                f"{path}:{lineno}: lines end in a carriage return alone (CR, old Mac line ends); JSON Lines need "
                "LF or CRLF line ends"
            ) from exc
        raise PromptFormatError(f"{path}:{lineno}: malformed JSON line ({_json_reason(exc)})") from exc
    _check_encodable(path, lineno, obj)
    return obj


def _check_encodable(path: Path, lineno: int, obj: Any) -> None:
    """Refuse a record whose strings hold a lone surrogate (``"\\ud800"``: valid JSON, not text)."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise PromptFormatError(
            f"{path}:{lineno}: a lone surrogate ({bad.encode('unicode_escape').decode()}) in a string: "
            "not text a tokenizer can take"
        ) from None


def _iter_json_array(path: Path) -> Iterator[tuple[int, Any]]:
    """Items of a JSON array with the line each starts on (errors carry the line too)."""
    data = _read_bytes(path)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
        lineno = data.count(b"\n", 0, exc.start + bom) + 1
        raise PromptFormatError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason})") from exc
    if "\x00" in text:
        raise PromptFormatError(f"{path}: NUL characters in the file: UTF-16 or UTF-32 text? prompt sources are UTF-8")
    decoder = json.JSONDecoder(object_pairs_hook=reject_duplicate_keys)
    line, counted = 1, 0

    def line_at(pos: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    try:
        i = _WS.match(text, 0).end()
        if not text.startswith("[", i):
            obj = load_json(text)
            raise PromptFormatError(f"{path}: a .json prompt source must be an array of records, got {json_type(obj)}")
        i = _WS.match(text, i + 1).end()
        if text.startswith("]", i):
            i += 1
        else:
            while True:
                start = line_at(i)
                try:
                    obj, end = decoder.raw_decode(text, i)
                except (RecursionError, JSONLimitError) as exc:
                    why = (
                        exc
                        if isinstance(exc, JSONLimitError)
                        else f"JSON nested more than {MAX_JSON_DEPTH} levels deep"
                    )
                    raise PromptFormatError(f"{path}:{start}: {why}") from None
                if json_depth(obj) > MAX_JSON_DEPTH:
                    raise PromptFormatError(f"{path}:{start}: JSON nested more than {MAX_JSON_DEPTH} levels deep")
                _check_encodable(path, start, obj)
                yield start, obj
                i = _WS.match(text, end).end()
                if text.startswith(",", i):
                    i = _WS.match(text, i + 1).end()
                elif text.startswith("]", i):
                    i += 1
                    break
                else:
                    raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
        i = _WS.match(text, i).end()
        if i != len(text):
            raise json.JSONDecodeError("Extra data", text, i)
    except JSONLimitError as exc:
        raise PromptFormatError(f"{path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise PromptFormatError(f"{path}:{exc.lineno}: malformed JSON ({_json_reason(exc)})") from exc


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pandas as pd  # lazy: only parquet sources need it

    try:
        frame = pd.read_parquet(io.BytesIO(_read_bytes(path)))
    except PromptFormatError:
        raise
    except Exception as exc:  # pyarrow's errors (ArrowInvalid, ...) are not a common base class
        raise PromptFormatError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from exc
    for i, row in enumerate(frame.to_dict(orient="records"), start=1):
        yield i, {k: _to_python(v) for k, v in row.items()}


def _json_reason(exc: json.JSONDecodeError) -> str:
    """``<decoder message> at column N``; some messages already end in "at" ("Unterminated string starting at")."""
    msg = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"{msg} at column {exc.colno}"


def iter_source_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_or_row_number, object)`` for each record of a source file (1-based numbers).

    ``.jsonl`` and ``.json`` yield the line a record starts on; ``.parquet`` yields the row number.

    Raises:
        FileNotFoundError: the file does not exist. IsADirectoryError: it is a directory.
        PromptFormatError: gzip data in a file not named ``.gz``, a line is not valid JSON or not UTF-8 (naming
            file and line), a ``.json`` file is not
            an array, a ``.gz`` file is truncated or corrupt, a parquet file cannot be read, or the suffix is not
            one of ``.jsonl``, ``.json``, ``.parquet`` (optionally followed by ``.gz``).
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"prompt source {path} is a directory, not a file: list each of its files as a source")
    if not path.is_file():
        raise FileNotFoundError(f"prompt source {path} does not exist")
    suffix = _base_suffix(path)
    if path.suffix != ".gz" and suffix in (".jsonl", ".json"):
        with open(path, "rb") as fh:
            if fh.read(2) == b"\x1f\x8b":
                raise PromptFormatError(
                    f"{path}: gzip-compressed data in a file not named .gz; rename it {path.name}.gz (it is then "
                    "decompressed) or decompress it"
                )
    if suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif suffix == ".json":
        yield from _iter_json_array(path)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise PromptFormatError(
            f"{path}: unknown prompt source format {suffix or path.name!r} (use .jsonl, .json or .parquet, "
            "optionally followed by .gz)"
        )


def source_location(path: str | Path, number: int) -> str:
    """How messages name record ``number`` of a source: ``file:line``, or ``file: row N`` for parquet."""
    path = Path(path)
    return f"{path}: row {number}" if _base_suffix(path) == ".parquet" else f"{path}:{number}"


def record_where(record: dict) -> str:
    """How messages name a prompt record: ``file:line (id <id>)`` (:func:`source_location`) when it carries its
    ``source`` and ``line``, as :func:`load_prompts` records do, else its ``id``."""
    if record.get("source") and record.get("line"):
        return f"{source_location(record['source'], record['line'])} (id {record.get('id')})"
    return str(record.get("id"))


def _to_python(value: Any) -> Any:
    """Turn numpy arrays/scalars from a parquet row into plain lists and scalars; a missing value becomes ``None``."""
    if value is None or type(value).__name__ == "NAType" or (isinstance(value, float) and value != value):
        return None
    if hasattr(value, "tolist"):
        return _to_python(value.tolist())
    if isinstance(value, list):
        return [_to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_python(v) for k, v in value.items()}
    return value


def _content_text(content: Any, where: str, at: str) -> str:
    """A message's content as text: a string, or the joined ``text`` of a list of OpenAI text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else json_type(part)
                raise PromptFormatError(
                    f"{where}: {at} content[{k}] is not a text part ({kind!r}); only text prompts are supported"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise PromptFormatError(f"{where}: {at} content must be a string or a list of text parts, got {json_type(content)}")


def _tool_call(call: Any, where: str, at: str) -> dict:
    """One OpenAI tool call ``{"type": "function", "function": {"name", "arguments"}}`` (``id`` kept when given)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise PromptFormatError(
            f"{where}: {at} must be {{'type': 'function', 'function': {{'name': str, 'arguments': ...}}}}"
        )
    out = {"type": "function", "function": {"name": fn["name"], "arguments": fn.get("arguments", {})}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _message(msg: dict, role: str, where: str, at: str) -> dict:
    """One normalised message: ``role``, ``content`` (text) and, where given, ``tool_calls``, ``tool_call_id``,
    ``name``."""
    content = msg.get("content", msg.get("value"))
    if role == "function_call":  # ShareGPT tool format: the value is the call as JSON
        try:
            call = json.loads(content) if isinstance(content, str) else content
        except json.JSONDecodeError as exc:
            raise PromptFormatError(f"{where}: {at} (function_call) is not JSON ({exc.msg})") from exc
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise PromptFormatError(f"{where}: {at} (function_call) must be a JSON object with a 'name'")
        return {"role": "assistant", "content": "", "tool_calls": [_tool_call({"function": call}, where, at)]}
    role = ROLE_ALIASES[role]
    out = {"role": role}
    calls = msg.get("tool_calls") if role == "assistant" else None
    if calls is not None and not isinstance(calls, list):
        raise PromptFormatError(f"{where}: {at}.tool_calls must be a list, got {json_type(calls)}")
    out["content"] = "" if content is None and calls else _content_text(content, where, at)
    if calls:
        out["tool_calls"] = [_tool_call(c, where, f"{at}.tool_calls[{k}]") for k, c in enumerate(calls)]
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(msg.get(k), str):
                out[k] = msg[k]
    return out


def record_tools(obj: dict, where: str) -> list | None:
    """The tool definitions of a record (its ``tools``: a list, or a JSON text of one, as ShareGPT tool datasets
    store it), or None when it has none.

    Raises:
        PromptFormatError: ``tools`` is neither a list nor the JSON text of one.
    """
    tools = obj.get("tools")
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise PromptFormatError(f"{where}: 'tools' is a string but not JSON ({exc.msg})") from exc
    if not isinstance(tools, list):
        raise PromptFormatError(f"{where}: 'tools' must be a list of tool definitions, got {json_type(tools)}")
    return tools or None


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """``messages`` with ``system_prompt`` as a first system turn, unless it is None or the record has its own."""
    if not system_prompt or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


# Keys whose text a plain-text record holds besides its prompt and that a prompt leaves out by design: the reference
# answer, which the verifier regenerates (Alpaca's `output`, GSM8K's `answer`, preference pairs), and ids.
ANSWER_KEYS = frozenset(
    {
        "output",
        "response",
        "completion",
        "answer",
        "answers",
        "chosen",
        "rejected",
        "target",
        "reference",
        "solution",
        "canonical_solution",
    }
)


def _keys_of(obj: dict) -> str:
    """A record's keys for an error message: ``'input', 'instruction'``, or ``none``."""
    return ", ".join(repr(k) for k in sorted(obj)) or "none"


def _is_key_path(name: str) -> bool:
    """A record key or a nested key's dotted path (``instances.0.input``): identifiers and list indexes."""
    parts = name.split(".")
    return bool(parts) and parts[0].isidentifier() and all(p.isidentifier() or p.isdigit() for p in parts[1:])


_MISSING = object()


def lookup(obj: Any, key: str) -> Any:
    """A record's value under ``key``: a top-level key, or a nested key's dotted path through objects and lists
    (``instances.0.input``: the ``input`` of the first of the ``instances``, as in Alpaca's seed tasks). A top-level
    key that holds dots itself wins. Returns :data:`_MISSING` when the path leads nowhere."""
    if isinstance(obj, dict) and key in obj:
        return obj[key]
    value = obj
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def template_keys(template: str) -> list[str]:
    """The record keys a source's ``template`` names (``"{instruction}\\n\\n{input}"`` -> ``["instruction",
    "input"]``), in order, each once.

    Raises:
        ValueError: the template is not a valid ``str.format`` string, names no key, or uses positional fields,
            attributes, indexes or conversions.
    """
    import string

    keys: list[str] = []
    try:
        for _, name, spec, conversion in string.Formatter().parse(template):
            if name is None:
                continue
            if not _is_key_path(name) or spec or conversion:
                # a nested key's dotted path ({instances.0.input}) is a plain key too (lookup)
                raise ValueError(f"{{{name}}} is not a plain key (write {{key}} with a record key's name)")
            if name not in keys:
                keys.append(name)
    except ValueError as exc:
        raise ValueError(f"not a valid template ({exc}); literal braces are written {{{{ and }}}}") from None
    if not keys:
        raise ValueError("names no record key (write {key} where a record key's text goes)")
    return keys


def mapping_keys(src: dict) -> tuple[str, ...]:
    """The keys a source's mapping reads the prompt text from: its ``field`` (a key or a list of keys), the keys of
    its ``template``, or () for shape detection."""
    if src.get("template"):
        return tuple(template_keys(src["template"]))
    fld = src.get("field")
    if fld is None:
        return ()
    return (fld,) if isinstance(fld, str) else tuple(fld)


def mapped_text(obj: dict, where: str, src: dict) -> str | None:
    """The prompt text of a plain-text record under its source's ``field`` or ``template``; None when the source
    has neither (the record's shape decides).

    - ``field: key``: that key's text;
    - ``field: [k1, k2, ...]``: the non-empty texts of the keys, in order, joined by a blank line (Alpaca's
      ``instruction`` then ``input``); a key a record lacks counts as empty;
    - ``template: "{instruction}\\n\\nInput: {input}"``: ``str.format`` with the record's texts.

    Raises:
        PromptFormatError: naming ``where``: a record with none of the keys (a template: without one of them), or
            a value that is not a string.
    """
    keys = mapping_keys(src)
    if not keys:
        return None
    found = _keys_of(obj)
    template = src.get("template")
    got = {k: lookup(obj, k) for k in keys}
    if len(keys) == 1 and not template:
        if got[keys[0]] is _MISSING:
            raise PromptFormatError(f"{where}: record has no key {keys[0]!r} (its keys: {found})")
    elif not template and all(v is _MISSING for v in got.values()):
        raise PromptFormatError(
            f"{where}: record has none of the keys {', '.join(map(repr, keys))} (its keys: {found})"
        )
    values = []
    for k in keys:
        v = got[k]
        if template and v is _MISSING:
            raise PromptFormatError(f"{where}: record has no key {k!r}, which the template names (its keys: {found})")
        v = None if v is _MISSING else v
        if v is not None and not isinstance(v, str):
            raise PromptFormatError(f"{where}: {k!r} must be a string, got {json_type(v)}")
        values.append(v or "")
    if template:
        # each field by position: a nested key's path ({instances.0.input}) is no str.format field name
        return _positional(template, keys).format(*values)
    return "\n\n".join(v for v in values if v.strip())


def _positional(template: str, keys: list[str]) -> str:
    """``template`` with each ``{key}`` replaced by ``{i}``, ``i`` the key's index in ``keys``; literal braces kept."""
    import string

    out = []
    for literal, name, _, _ in string.Formatter().parse(template):
        out.append(literal.replace("{", "{{").replace("}", "}}"))
        if name is not None:
            out.append(f"{{{keys.index(name)}}}")
    return "".join(out)


#: Keys that label a record rather than hold its text (Alpaca seed tasks' ``name: breakfast_suggestion``): a value
#: under one of them without whitespace is no text a prompt leaves out.
LABEL_KEYS = frozenset({"name", "title", "category", "type", "task", "source", "tag", "lang", "language", "split"})


def _text_paths(value: Any, path: str):
    """``(dotted path, text)`` of every non-empty string in a record's value, through nested objects and lists."""
    if isinstance(value, str):
        if value.strip():
            yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _text_paths(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _text_paths(v, f"{path}.{i}")


def ignored_text_keys(obj: dict, src: dict, used: tuple[str, ...]) -> list[str]:
    """The keys of a plain-text record that hold non-empty text the prompt leaves out, by the key (or the nested
    key's dotted path, ``instances.0.input``) that holds it: not read by the mapping (``used``), not an answer key
    (:data:`ANSWER_KEYS`, at any depth), not ``id`` or ``*_id``, not a label without whitespace
    (:data:`LABEL_KEYS`), not in the source's ``ignore`` (a key there silences everything under it)."""
    skip = set(used) | set(src.get("ignore") or ())
    found = []
    for k, v in obj.items():
        for path, text in _text_paths(v, k):
            parts = path.split(".")
            names = [p for p in parts if not p.isdigit()]
            if any(".".join(parts[:n]) in skip for n in range(1, len(parts) + 1)):
                continue
            if any(n in ANSWER_KEYS or n == "id" or n.endswith("_id") for n in names):
                continue
            if names[-1] in LABEL_KEYS and not any(c.isspace() for c in text):
                continue
            found.append(path)
    return found


def normalise_record(
    obj: Any, where: str, text_field: str | list[str] | None = None, template: str | None = None
) -> list[dict]:
    """Turn one source record into a chat prompt ``[{"role", "content"}, ...]`` ending in a user turn.

    Args:
        obj: the parsed record.
        where: ``"file:line"`` for error messages.
        text_field: if given, the key (or list of keys, :func:`mapped_text`) holding plain prompt text (overrides
            shape detection).
        template: if given, a ``str.format`` template of the record's keys that makes the prompt text.

    Returns:
        The messages, ending in a user or tool turn; an empty list when the record holds no prompt to answer (an
        empty or whitespace-only prompt, an empty message list, no user or tool turn after the trailing assistant
        turns): the caller drops it.

    Raises:
        PromptFormatError: naming ``where`` when the record is not an object, has none of the accepted keys,
            or has a prompt or message list of the wrong type or with an unknown role.
    """
    if not isinstance(obj, dict):
        raise PromptFormatError(f"{where}: expected a JSON object, got {json_type(obj)}")
    shape_field = text_field if text_field in CHAT_SHAPES else None
    if shape_field and shape_field not in obj:
        found = _keys_of(obj)
        raise PromptFormatError(f"{where}: record has no key {shape_field!r} (its keys: {found})")
    mapped = None if shape_field else mapped_text(obj, where, {"field": text_field, "template": template})
    key = shape_field or (None if mapped is not None else next((k for k in SHAPE_KEYS if k in obj), None))
    if mapped is None and key is None:
        found = _keys_of(obj)
        wanted = ", ".join(repr(k) for k in SHAPE_KEYS)
        raise PromptFormatError(f"{where}: record has none of the keys {wanted} (its keys: {found})")
    value = obj[key] if key else mapped
    if mapped is not None:
        messages = [{"role": "user", "content": mapped}]
    elif key == "prompt":
        if not isinstance(value, str):
            raise PromptFormatError(f"{where}: {key!r} must be a string, got {json_type(value)}")
        messages = [{"role": "user", "content": value}]
    elif key == "turns":
        if not isinstance(value, list) or (value and not isinstance(value[0], str)):
            raise PromptFormatError(f"{where}: 'turns' must be a list of strings")
        messages = [{"role": "user", "content": value[0]}] if value else []
    else:
        if not isinstance(value, list):
            raise PromptFormatError(f"{where}: {key!r} must be a list of messages, got {json_type(value)}")
        messages = []
        for j, msg in enumerate(value):
            at = f"{key}[{j}]"
            if not isinstance(msg, dict):
                raise PromptFormatError(f"{where}: {at} must be an object, got {json_type(msg)}")
            role = msg.get("role", msg.get("from"))
            if role is None:
                raise PromptFormatError(f"{where}: {at} has no 'role' (or 'from')")
            if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
                accepted = ", ".join(sorted(ROLE_ALIASES))
                raise PromptFormatError(f"{where}: {at} has unknown role {role!r} (accepted: {accepted})")
            messages.append(_message(msg, role.lower(), where, at))
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] not in ("user", "tool") or not messages[-1]["content"].strip():
        return []
    return messages


def load_prompts(sources: Iterable[dict], system_prompt: str | None = None) -> tuple[list[dict], PromptStats]:
    """Read every source, normalise, and drop empty prompts and duplicates (first occurrence wins).

    Args:
        sources: dicts with ``path`` and an optional mapping of plain-text records: ``field`` (a key or a list of
            keys, :func:`mapped_text`; a nested key by its dotted path, :func:`lookup`) or ``template``; ``ignore``
            lists keys whose text is no part of the prompt; ``max_records`` reads only the source's first records.
        system_prompt: ``prompts.system_prompt``: the first turn of every record without a system turn (part of
            the record, so of its id and of the prompt set's fingerprint).

    Returns:
        ``(records, stats)``; records (``id``, ``messages``, ``tools`` when the source gives tool definitions,
        ``source``, ``line``) are sorted by id.

    Raises:
        FileNotFoundError: a source does not exist.
        PromptFormatError: see :func:`iter_source_rows` and :func:`normalise_record`; also a source with no
            records at all, and an explicit ``id`` used twice in one source for different prompts (naming both
            lines).
    """
    stats = PromptStats()
    seen: dict[str, dict] = {}
    sources = list(sources)
    paths = Counter(str(Path(src["path"])) for src in sources)
    for i, src in enumerate(sources):
        path = Path(src["path"])
        # a file listed twice (with different fields) gets one entry per listing
        label = str(path) if paths[str(path)] == 1 else f"{path} (prompts.sources[{i}])"
        counts = Counter()
        ignored: Counter = Counter()
        ignored_at: dict[str, str] = {}
        used = mapping_keys(src)
        explicit_ids: dict[str, tuple[str, str]] = {}
        cap = src.get("max_records")
        for number, obj in iter_source_rows(path):
            if cap is not None and counts["read"] >= cap:
                break  # prompts.sources[i].max_records: the source's first records only
            counts["read"] += 1
            where = source_location(path, number)
            messages = normalise_record(obj, where, src.get("field"), src.get("template"))
            plain = (
                src.get("field") not in CHAT_SHAPES
                if used
                else (isinstance(obj, dict) and next((k for k in SHAPE_KEYS if k in obj), None) == "prompt")
            )
            if plain:
                for k in ignored_text_keys(obj, src, used or ("prompt",)):
                    ignored[k] += 1
                    ignored_at.setdefault(k, where)
            if not messages:
                counts["empty"] += 1
                if len(stats.empty_at) < MAX_EMPTY_AT:
                    stats.empty_at.append(where)
                continue
            messages = with_system_prompt(messages, system_prompt)
            tools = record_tools(obj, where)
            pid = prompt_id(messages, tools)
            if obj.get("id") is not None:
                key = json.dumps(obj["id"], sort_keys=True)
                first = explicit_ids.setdefault(key, (where, pid))
                if first[1] != pid:
                    raise PromptFormatError(
                        f"{where}: id {obj['id']!r} was already used for a different prompt at {first[0]}"
                    )
            if pid in seen:
                counts["duplicates"] += 1
                continue
            seen[pid] = {
                "id": pid,
                "messages": messages,
                **({"tools": tools} if tools else {}),
                "source": str(path),
                "line": number,
            }
            counts["kept"] += 1
        if not counts["read"]:
            raise PromptFormatError(f"{path}: the prompt source has no records")
        stats.per_source[label] = dict(counts)
        if ignored:
            stats.per_source[label]["ignored_text"] = dict(sorted(ignored.items()))
            stats.warnings.extend(
                _ignored_warning(i, path, src, used or ("prompt",), k, n, counts["read"], ignored_at[k])
                for k, n in sorted(ignored.items())
            )
        stats.read += counts["read"]
        stats.empty += counts["empty"]
        stats.duplicates += counts["duplicates"]
    records = [seen[k] for k in sorted(seen)]
    stats.kept = len(records)
    return records, stats


def _ignored_warning(i: int, path: Path, src: dict, used: tuple[str, ...], key: str, n: int, read: int, at: str) -> str:
    """The warning for text a source's mapping leaves out of its prompts (:func:`ignored_text_keys`)."""
    how = (
        f"template {src['template']!r}"
        if src.get("template")
        else (f"field {src['field']!r}" if src.get("field") is not None else "the 'prompt' key")
    )
    fields = ", ".join([*used, key])
    return (
        f"prompts.sources[{i}] ({path}): {n} of {read} record(s) have text under {key!r}, which {how} leaves out of "
        f"the prompt (the first at {at}); to keep it, combine the keys (field: [{fields}]) or write a template; to "
        f"silence this, add ignore: [{key}]"
    )


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
