"""Prompt source files read row by row: JSONL, a JSON array, parquet, each optionally gzipped; every error names the
file and the line (or row), see :mod:`draftpipe.formats.prompts` for what the rows become."""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftpipe.core.io import MAX_JSON_DEPTH, JSONLimitError, json_depth, load_json, reject_duplicate_keys

SUFFIXES = (".jsonl", ".json", ".parquet")


_WS = re.compile(r"[ \t\n\r]*")


class PromptFormatError(ValueError):
    """A prompt source has a line or record that cannot be read; the message names file and line."""


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
        yield i, {k: to_python(v) for k, v in row.items()}


def _json_reason(exc: json.JSONDecodeError) -> str:
    """``<decoder message> at column N``; some messages already end in "at" ("Unterminated string starting at")."""
    msg = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"{msg} at column {exc.colno}"


def to_python(value: Any) -> Any:
    """Turn numpy arrays/scalars from a parquet row into plain lists and scalars; a missing value becomes ``None``."""
    if value is None or type(value).__name__ == "NAType" or (isinstance(value, float) and value != value):
        return None
    if hasattr(value, "tolist"):
        return to_python(value.tolist())
    if isinstance(value, list):
        return [to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    return value


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
    """How messages name record ``number`` of a source: ``file:line``, or ``file: row N`` for parquet and for a Hub
    dataset (``hf://datasets/...``, :mod:`draftpipe.formats.hub_sources`)."""
    if str(path).startswith("hf://"):
        return f"{path}: row {number}"
    path = Path(path)
    return f"{path}: row {number}" if _base_suffix(path) == ".parquet" else f"{path}:{number}"
