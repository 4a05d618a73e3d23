"""Where a plain-text record keeps its prompt: a source's ``field`` (a key or a nested key path such as
``instances.0.input``) or ``template`` (``{key}`` placeholders), and the text a mapping leaves out."""

from __future__ import annotations

from typing import Any

from draftpipe.formats.prompt_sources import PromptFormatError, json_type

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


def keys_of(obj: dict) -> str:
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
    found = keys_of(obj)
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
