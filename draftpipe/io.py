"""Atomic artifact writes: a finished file is either complete or absent, never half-written.

Every writer here writes to a temporary file in the destination's directory and renames it over the
destination with :func:`os.replace` (atomic on POSIX within one file system). A process killed part-way
leaves only a ``.<name>.tmp-*`` file behind, which no rule ever takes as input.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it to ``path`` when the block succeeds.

    Args:
        path: the final destination. Its parent directory is created if needed.

    Yields:
        A path in the same directory that the caller writes the complete artifact to.

    Raises:
        Whatever the block raises; the temporary file is removed and ``path`` is left untouched.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    try:
        yield tmp_path
        # the writer may have replaced the file (safetensors does): give the artifact the umask's mode, not
        # mkstemp's 0600, so that others on a shared node can read it
        os.chmod(tmp_path, 0o666 & ~umask)
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON to ``path`` atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write one JSON object per line to ``path`` atomically; return the number of lines."""
    n = 0
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n")
                n += 1
    return n


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL artifact written by :func:`write_jsonl`.

    Raises:
        ValueError: naming the file and 1-based line number of a line that is not a JSON object.
    """
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            out.append(rec)
    return out


def check_jsonl(path: str | os.PathLike) -> str | None:
    """Why a JSONL artifact is unusable (not ending in a newline, a line that is not a JSON object), or None."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if data and not data.endswith(b"\n"):
        return "truncated (no final newline)"
    for lineno, line in enumerate(data.splitlines(), 1):
        try:
            if not isinstance(json.loads(line), dict):
                return f"line {lineno} is not a JSON object"
        except ValueError:
            return f"line {lineno} is not valid JSON"
    return None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def sha256_text(text: str) -> str:
    """Hex SHA-256 of a string's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
