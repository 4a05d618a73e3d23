"""Prompt sets: read sources, normalise to chat records, deduplicate, split train/eval and shard.

A *record* is ``{"id": str, "messages": [{"role": str, "content": str}, ...], "source": str, "line": int}``.
``id`` is the first 16 hex digits of the SHA-256 of the canonical JSON of ``messages``, so it depends on content
only: the same prompt in two files, or on another line, gets the same id. The train/eval split and the shard of a
training prompt are functions of the id alone, so appending prompts to a source never moves an existing prompt to
another split or shard.

Accepted source formats (chosen by file suffix; ``.gz`` is decompressed; read by
:mod:`draftpipe.formats.prompt_sources`):

- ``.jsonl``: one JSON object per line (blank lines are skipped, a UTF-8 byte-order mark is ignored);
- ``.json``: a JSON array of objects;
- ``.parquet``: one object per row (read with pandas).

Accepted record shapes (the first key found wins, unless the source names ``field``):

- ``messages``: OpenAI chat, ``[{"role": "user"|"assistant"|"system"|"tool", "content": str}, ...]``; ``content``
  may also be a list of text parts ``[{"type": "text", "text": str}, ...]``, which are joined; an assistant turn's
  ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``, its ``content`` may then be null)
  and a tool turn's ``tool_call_id`` and ``name`` are kept; the record's ``tools`` (tool definitions) are kept as
  the record's ``tools``; an assistant turn whose ``content`` is null and that calls no tool is unanswered
  (:data:`UNANSWERED`): the verifier writes it;
- ``conversations``: ShareGPT, ``[{"from": "human"|"gpt"|"system"|"observation"|"function_call", "value": str},
  ...]``; ``function_call`` (a JSON ``{"name", "arguments"}``) becomes an assistant turn with that tool call,
  ``observation`` a tool turn; a ``tools`` key (a list, or its JSON text) becomes the record's ``tools``;
- ``turns``: MT-bench, a list of user turns; an *unanswered* assistant turn (:data:`UNANSWERED`) is put between
  each two of them: the verifier writes it in the completions stage; a stage that only prompts the verifier
  sends the conversation up to its first unanswered turn (:func:`answered_prefix`), i.e. MT-bench's first question
  (the benchmarks then ask the later ones after the verifier's own answers: :mod:`draftpipe.bench.prompts`);
- ``prompt`` (or ``field``/``template``, :mod:`draftpipe.formats.prompt_fields`): plain text, taken as one user
  turn.

Trailing assistant turns are removed: the verifier regenerates the answer (EAGLE-3 data regeneration). Earlier
turns are kept whole: the completions stage regenerates every assistant turn on the verifier's own history
(``completions.turns: all``) and keeps the source's tool-call turns and tool results as context. A conversation
may end in a user or a tool turn. ``prompts.system_prompt`` is put first in every record without a system turn.

What is an error and what is dropped. The loader is lenient on data and strict on structure:

- *dropped and counted* (``PromptStats.empty``, with the first locations in ``PromptStats.empty_at``): a record
  whose structure is valid but that holds no prompt to answer: an empty or whitespace-only prompt, an empty
  ``messages``/``conversations``/``turns`` list, or a conversation with no user turn left after the trailing
  assistant turns are removed or none before its first unanswered assistant turn;
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

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftpipe.formats.hub_sources import dataset_rows_file, with_shortcut
from draftpipe.formats.prompt_fields import ignored_text_keys, keys_of, mapped_text, mapping_keys
from draftpipe.formats.prompt_sources import PromptFormatError, iter_source_rows, json_type, source_location

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
#: an assistant turn with no source text: the completions stage regenerates it whatever ``completions.turns`` says
#: (there is nothing to keep as context), and prompts are sent only up to the first one (:func:`answered_prefix`)
UNANSWERED = {"role": "assistant", "content": None}
#: ``completions.turns``: regenerate every assistant turn, or only the answer to the last one
TURNS = ("all", "last")
CHAT_SHAPES = SHAPE_KEYS[:3]  # the shapes that are conversations, not plain text
#: how many locations of dropped empty prompts :class:`PromptStats` keeps
MAX_EMPTY_AT = 10


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


def record_where(record: dict) -> str:
    """How messages name a prompt record: ``file:line (id <id>)`` (:func:`source_location`) when it carries its
    ``source`` and ``line``, as :func:`load_prompts` records do, else its ``id``."""
    if record.get("source") and record.get("line"):
        return f"{source_location(record['source'], record['line'])} (id {record.get('id')})"
    return str(record.get("id"))


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
    if content is None and role == "assistant" and not calls:
        return dict(UNANSWERED)
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


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def is_unanswered(message: dict) -> bool:
    """Whether ``message`` is an unanswered assistant turn (:data:`UNANSWERED`): the verifier writes it."""
    return message.get("role") == "assistant" and message.get("content") is None and not message.get("tool_calls")


def answered_prefix(messages: list[dict]) -> list[dict]:
    """``messages`` up to (not including) the first unanswered assistant turn (:func:`is_unanswered`): the part of
    a conversation a stage that only prompts the verifier can send (MT-bench's first question); all of them when
    none is unanswered."""
    cut = next((i for i, m in enumerate(messages) if is_unanswered(m)), len(messages))
    return messages[:cut]


def generation_points(messages: list[dict], turns: str = "all") -> list[int]:
    """Where the verifier answers in a conversation: the index of each assistant message of the source it
    regenerates, and ``len(messages)`` for the answer to the last turn.

    With ``turns="all"`` every assistant message is regenerated except one that calls tools (``tool_calls``): the
    tool results after it answer that call, so the call stays as context, never trained on. With ``"last"`` only the
    final answer is generated and the source's assistant turns stay as context. An unanswered assistant turn
    (:func:`is_unanswered`: MT-bench's answers) has no text to keep, so it is generated
    (and trained on) with either.

    Raises:
        ValueError: ``turns`` is not one of :data:`TURNS`.
    """
    if turns not in TURNS:
        raise ValueError(f"completions.turns: unknown value {turns!r} (use all or last)")
    points = [
        i
        for i, m in enumerate(messages)
        if is_unanswered(m) or (turns == "all" and m["role"] == "assistant" and not m.get("tool_calls"))
    ]
    return [*points, len(messages)]


def with_system_prompt(messages: list[dict], system_prompt: str | None) -> list[dict]:
    """``messages`` with ``system_prompt`` as a first system turn, unless it is None or the record has its own."""
    if not system_prompt or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


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
        turns, or none before the first unanswered assistant turn): the caller drops it.

    Raises:
        PromptFormatError: naming ``where`` when the record is not an object, has none of the accepted keys,
            or has a prompt or message list of the wrong type or with an unknown role.
    """
    if not isinstance(obj, dict):
        raise PromptFormatError(f"{where}: expected a JSON object, got {json_type(obj)}")
    shape_field = text_field if text_field in CHAT_SHAPES else None
    if shape_field and shape_field not in obj:
        found = keys_of(obj)
        raise PromptFormatError(f"{where}: record has no key {shape_field!r} (its keys: {found})")
    mapped = None if shape_field else mapped_text(obj, where, {"field": text_field, "template": template})
    key = shape_field or (None if mapped is not None else next((k for k in SHAPE_KEYS if k in obj), None))
    if mapped is None and key is None:
        found = keys_of(obj)
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
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise PromptFormatError(f"{where}: 'turns' must be a list of strings")
        asked = [t for t in value if t.strip()]  # a blank question asks nothing: the others stay
        messages = [m for k, t in enumerate(asked) for m in ([dict(UNANSWERED)] if k else []) + [_user(t)]]
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
    first = answered_prefix(messages)  # the first prompt the verifier answers
    for prompt in (messages, first):
        if not prompt or prompt[-1]["role"] not in ("user", "tool") or not prompt[-1]["content"].strip():
            return []
    return messages


def _is_plain_text(obj: Any, src: dict, used: tuple[str, ...]) -> bool:
    """Whether a record is read as plain text (a ``field``/``template`` mapping that is not a chat shape, or a
    ``prompt`` key first among the shapes): the records whose text outside the prompt is counted."""
    if used:
        return src.get("field") not in CHAT_SHAPES
    return isinstance(obj, dict) and next((k for k in SHAPE_KEYS if k in obj), None) == "prompt"


def _check_explicit_id(obj: dict, where: str, pid: str, explicit_ids: dict[str, tuple[str, str]]) -> None:
    """A source's explicit ``id`` names one prompt: the same id on a different prompt of the same source is an error
    naming both lines (``explicit_ids``: the source's ids so far, ``{id as JSON: (where, prompt id)}``).

    Raises:
        PromptFormatError: ``<where>: id <id> was already used for a different prompt at <first where>``.
    """
    if obj.get("id") is None:
        return
    first = explicit_ids.setdefault(json.dumps(obj["id"], sort_keys=True), (where, pid))
    if first[1] != pid:
        raise PromptFormatError(f"{where}: id {obj['id']!r} was already used for a different prompt at {first[0]}")


def open_source(src: dict, field: str) -> tuple[str, dict, Path]:
    """``(name, settings, file)`` of a source entry: a local file is its own name and file; a Hub dataset
    (``dataset``, :mod:`draftpipe.formats.hub_sources`) is named ``hf://datasets/ORG/NAME@<commit>/...``, its
    shortcut's settings filled in, and read from the rows it was streamed to (one row per line).

    Raises:
        draftpipe.formats.hub_sources.HubSourceError: a Hub source that cannot be resolved or read."""
    if src.get("dataset") is None:
        return str(Path(src["path"])), src, Path(src["path"])
    settings = with_shortcut(src)
    ds, rows = dataset_rows_file(settings, field)
    return ds.label, settings, rows


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
    opened = [open_source(src, f"prompts.sources[{i}]") for i, src in enumerate(sources)]
    paths = Counter(name for name, _, _ in opened)
    for i, (path, src, rows) in enumerate(opened):
        # a file listed twice (with different fields) gets one entry per listing
        label = str(path) if paths[path] == 1 else f"{path} (prompts.sources[{i}])"
        counts = Counter()
        ignored: Counter = Counter()
        ignored_at: dict[str, str] = {}
        used = mapping_keys(src)
        explicit_ids: dict[str, tuple[str, str]] = {}
        cap = src.get("max_records")
        for number, obj in iter_source_rows(rows):
            if cap is not None and counts["read"] >= cap:
                break  # prompts.sources[i].max_records: the source's first records only
            counts["read"] += 1
            where = source_location(path, number)
            messages = normalise_record(obj, where, src.get("field"), src.get("template"))
            if _is_plain_text(obj, src, used):
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
            _check_explicit_id(obj, where, pid, explicit_ids)
            if pid in seen:
                counts["duplicates"] += 1
                continue
            seen[pid] = {
                "id": pid,
                "messages": messages,
                **({"tools": tools} if tools else {}),
                "source": path,
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
