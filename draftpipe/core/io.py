"""Atomic artifact writes: a finished file is either complete or absent, never half-written.

Every writer here writes to a temporary file in the destination's directory and renames it over the
destination with :func:`os.replace` (atomic on POSIX within one file system). A process killed part-way
leaves only a ``.<name>.tmp-*`` file behind, which no rule ever takes as input.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory next to ``path`` (``.<name>.tmp-*``); when the block succeeds, make it ``path``.

    The finished directory's files and the directory itself are fsynced and given the umask's mode (not
    ``mkdtemp``'s 0700), then renamed into place; an existing ``path`` is moved aside (``.<name>.old-*``) only
    then and deleted after, so a process killed at any point leaves either the old or the new directory complete
    under ``path``, or none, never a partial one (:func:`remove_interrupted_writes` removes what it leaves beside).

    Raises:
        Whatever the block raises; the temporary directory is removed and ``path`` is left untouched.
    """
    import shutil

    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file() and not f.is_symlink():
                _fsync(f)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        _fsync(tmp)
        old = None
        if dest.exists() or dest.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.rmdir(old)
            os.replace(dest, old)
        try:
            os.replace(tmp, dest)
        except BaseException:
            if old is not None:
                os.replace(old, dest)
            raise
        _fsync(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str]) -> None:
    """Write ``tensors`` (name -> torch tensor) and string ``metadata`` as one safetensors file, atomically and
    with a canonical header, so that equal contents give equal bytes.

    safetensors keeps ``__metadata__`` in a hash map, serialised in an order that differs from process to process;
    the header is rewritten in place with the metadata keys sorted (same length, JSON kept compact, padded with
    spaces as safetensors pads it).

    Raises:
        ValueError: a metadata value is not a string (safetensors' own rule).
    """
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        canonicalize_safetensors_header(tmp)


#: bytes per element of each safetensors dtype (the format's dtype names)
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: the largest header the safetensors library itself accepts (bytes)
MAX_SAFETENSORS_HEADER = 100_000_000


#: deepest nesting of arrays and objects in any JSON this package reads (a prompt record, a safetensors header, a
#: manifest or config is a few levels deep; Python's own reader fails with RecursionError near 1,000 levels)
MAX_JSON_DEPTH = 64


class JSONLimitError(ValueError):
    """JSON beyond :func:`load_json`'s limits (nesting, size, a repeated key); the message is the reason, without
    the path."""


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook`` of a JSON decoder that refuses an object repeating a key.

    Raises:
        JSONLimitError: ``key 'x' appears twice in one object``.
    """
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JSONLimitError(f"key {dup!r} appears twice in one object")
    return obj


def json_depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` and ``{}`` are 1), without recursion."""
    depth, stack = 0, [(obj, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict | list):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in (item.values() if isinstance(item, dict) else item))
    return depth


def load_json(
    text: str | bytes, *, max_bytes: int | None = None, max_depth: int = MAX_JSON_DEPTH, unique_keys: bool = False
) -> Any:
    """``json.loads`` for untrusted JSON, within limits: the one reader of prompt sources, safetensors headers,
    manifests and configs.

    Args:
        text: the JSON text (bytes are decoded as UTF-8, as ``json.loads`` does).
        max_bytes: refuse longer text before parsing it; None for no size limit.
        max_depth: refuse arrays and objects nested deeper (:data:`MAX_JSON_DEPTH`).
        unique_keys: refuse an object that repeats a key (``json.loads`` silently keeps the last value).

    Raises:
        JSONLimitError: too long, too deeply nested, or a repeated key; the message names the limit.
        ValueError: not valid JSON (``json.JSONDecodeError``, ``UnicodeDecodeError``).
    """
    if max_bytes is not None and len(text) > max_bytes:
        raise JSONLimitError(f"{len(text):,} bytes of JSON, more than the {max_bytes:,} allowed")
    try:
        obj = json.loads(text, object_pairs_hook=reject_duplicate_keys if unique_keys else None)
    except RecursionError:
        raise JSONLimitError(f"JSON nested more than {max_depth} levels deep") from None
    if json_depth(obj) > max_depth:
        raise JSONLimitError(f"JSON nested more than {max_depth} levels deep")
    return obj


def load_json_object(text: str | bytes, where: str) -> dict:
    """A JSON object from untrusted text (:func:`load_json`'s limits), every error a ``ValueError`` that starts with
    ``where`` (a file, or ``file:line``).

    Raises:
        ValueError: ``<where>: <limit>`` (:class:`JSONLimitError`), ``<where>: not valid JSON (<reason>)``, or
            ``<where>: expected a JSON object, got <type>``.
    """
    try:
        obj = load_json(text)
    except JSONLimitError as exc:
        raise ValueError(f"{where}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


class SafetensorsHeaderError(ValueError):
    """A safetensors file's framing is broken; the message is the reason, without the path."""


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, dict, int, int]:
    """The one reader of a safetensors file's header, without reading tensor data.

    Format (safetensors specification): 8-byte little-endian header length ``N`` (2 to
    :data:`MAX_SAFETENSORS_HEADER`), then ``N`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets"},
    "__metadata__": {str: str}}``, then the data.

    Returns:
        ``(tensors, metadata, data_start, size)``: the tensor entries as written (not checked here), the metadata
        (``{}`` when absent), the byte offset where data starts (``8 + N``) and the file's size in bytes.

    Raises:
        FileNotFoundError: the file does not exist.
        SafetensorsHeaderError: unreadable, truncated, a header length that is not sane, a header that is not a
            JSON object, or ``__metadata__`` that is not one.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise SafetensorsHeaderError(f"truncated: {size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(prefix, "little")
            if n < 2 or n > MAX_SAFETENSORS_HEADER:
                raise SafetensorsHeaderError(
                    f"header length {n} is not sane (safetensors allows 2..{MAX_SAFETENSORS_HEADER} bytes)"
                )
            if 8 + n > size:
                raise SafetensorsHeaderError(
                    f"truncated: the header is {n} bytes but only {size - 8} bytes follow its length"
                )
            raw = fh.read(n)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SafetensorsHeaderError(f"unreadable ({exc.strerror or exc})") from exc
    try:
        header = load_json(raw)
    except JSONLimitError as exc:
        raise SafetensorsHeaderError(f"header refused ({exc})") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsHeaderError(f"header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsHeaderError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise SafetensorsHeaderError("header __metadata__ is not a JSON object")
    return header, meta, 8 + n, size


def tensor_entry_problem(info: Any) -> str | None:
    """Why one tensor entry of a safetensors header is malformed, or None: the entry is an object whose ``dtype`` is a
    dtype of :data:`DTYPE_BYTES`, whose ``shape`` is a list of integers >= 0 and whose ``data_offsets``
    ``[begin, end]`` (``0 <= begin <= end``) span ``prod(shape)`` elements of that dtype (safetensors
    specification). Whether the spans tile the file is the caller's to check."""
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        return f"malformed header entry {info!r}"
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return f"unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        return f"malformed shape {shape!r}"
    if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
        return f"malformed data_offsets {[begin, end]!r}"
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        return (
            f"{dtype} {shape} needs {math.prod(shape) * DTYPE_BYTES[dtype]} bytes but data_offsets span {end - begin}"
        )
    return None


def canonicalize_safetensors_header(path: str | os.PathLike) -> bool:
    """Rewrite a safetensors file's header in place with ``__metadata__`` first and its keys sorted.

    The tensor entries keep their order and offsets, and the header keeps its length (the data section does not
    move). Returns False, leaving the file as it was, when the canonical header would not fit the original length
    (it never does for compact headers, the form safetensors writes).
    """
    with open(path, "rb+") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        meta = header.pop("__metadata__", None)
        canonical = {} if meta is None else {"__metadata__": dict(sorted(meta.items()))}
        canonical.update(header)
        raw = json.dumps(canonical, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(raw) > n:
            return False
        fh.seek(8)
        fh.write(raw.ljust(n, b" "))
    return True


def remove_interrupted_writes(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Remove what interrupted writes of ``paths`` left beside each path: ``.<name>.tmp-*`` files and directories
    (:func:`atomic_path`'s, :func:`draftpipe.runtime.store.link_output`'s, a directory artifact's build directory) and
    ``.<name>.old-*`` (a replaced directory not yet deleted). Call it only while nothing else can be writing those
    paths: a job's own outputs at its start (Snakemake runs one job per output). Returns the removed paths."""
    import shutil

    removed = []
    for path in paths:
        dest = Path(path)
        if not dest.parent.is_dir():
            continue
        name = glob.escape(dest.name)
        for left in [*dest.parent.glob(f".{name}.tmp-*"), *dest.parent.glob(f".{name}.old-*")]:
            if left.is_dir() and not left.is_symlink():
                shutil.rmtree(left, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    left.unlink()
            removed.append(left)
    return removed


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
    return [rec for _, rec in iter_jsonl(path)]


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` of each record of a JSONL artifact, one line in memory at a time.

    Raises:
        ValueError: as :func:`read_jsonl`.
    """
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            yield lineno, load_json_object(line, f"{path}:{lineno}")


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
            if not isinstance(load_json(line), dict):
                return f"line {lineno} is not a JSON object"
        except JSONLimitError as exc:
            return f"line {lineno}: {exc}"
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


def stat_key(path: str | os.PathLike) -> list[int]:
    """``[size, mtime_ns, inode]`` of a file: what says it has not changed since a cached result was computed."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def read_cache(cache_file: str | os.PathLike) -> dict:
    """A JSON cache file's object; empty when it is missing or damaged (a cache is never trusted over the files)."""
    try:
        cache = load_json(Path(cache_file).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def write_cache(cache_file: str | os.PathLike, cache: dict) -> None:
    """Write a JSON cache file atomically; a read-only tree is still checked, just not remembered."""
    with contextlib.suppress(OSError):
        write_json(cache_file, cache)


def cached_sha256s(paths: Iterable[str | os.PathLike], cache_file: str | os.PathLike | None) -> list[str]:
    """Hex SHA-256 of each file's bytes, each file read once per version of it.

    A file in a Hugging Face hub cache (a symlink to ``blobs/<sha256>``) is named by the SHA-256 of its bytes, so
    nothing is read. Otherwise the digest is remembered in ``cache_file`` (:func:`read_cache`) under the file's real
    path with its :func:`stat_key`: a verifier's weights (up to terabytes) are hashed once, not at every parse of
    the workflow, and a copy of the same bytes elsewhere is hashed again but gets the same digest. The cache is read
    and written once per call.

    Args:
        paths: the files.
        cache_file: where digests are remembered; None reads the files every time.

    Raises:
        OSError: a file cannot be read.
    """
    cache = read_cache(cache_file) if cache_file is not None else {}
    changed = False
    out = []
    for path in paths:
        real = Path(path).resolve()
        if real.parent.name == "blobs" and len(real.name) == 64 and all(c in "0123456789abcdef" for c in real.name):
            out.append(real.name)
            continue
        key = stat_key(real)
        hit = cache.get(str(real))
        if isinstance(hit, dict) and hit.get("stat") == key and isinstance(hit.get("sha256"), str):
            out.append(hit["sha256"])
            continue
        digest = sha256_file(real)
        cache[str(real)] = {"stat": key, "sha256": digest}
        changed = True
        out.append(digest)
    if changed and cache_file is not None:
        write_cache(cache_file, cache)
    return out


def cached_sha256(path: str | os.PathLike, cache_file: str | os.PathLike | None) -> str:
    """:func:`cached_sha256s` of one file."""
    return cached_sha256s([path], cache_file)[0]


def sha256_text(text: str) -> str:
    """Hex SHA-256 of a string's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def human(n: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"


def free_bytes(path: str | os.PathLike) -> tuple[int, Path]:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent), and that parent."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free, p


#: errno values of a file system with no room left: ENOSPC (no space left on device), EDQUOT (disk quota exceeded)
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: how libraries that raise no OSError report them, with the errno each names: Rust's ``io::Error`` (safetensors,
#: tokenizers: ``os error 28``) and C's strerror
NO_ROOM_TEXTS = {text: n for n in sorted(NO_ROOM_ERRNOS) for text in (f"os error {n}", os.strerror(n))}


@dataclass(frozen=True)
class NoRoom:
    """A failed write for want of disk space: ``path`` the file written when the system said so (None when the
    error did not name it), ``reason`` its words (``No space left on device``)."""

    path: str | None
    reason: str


def no_room(exc: BaseException) -> NoRoom | None:
    """Whether ``exc``, or an exception it was raised from or while handling (``__cause__``, ``__context__``),
    says that a disk is full: an ``OSError`` with errno ENOSPC or EDQUOT (its ``filename`` is the path), or a
    message with the Rust or C text of those errnos (safetensors' ``SafetensorError``). torch's ``torch.save``
    gives an ENOSPC only when it writes to a Python file object (to a path it says ``basic_ios::clear: iostream
    error``), so the package's checkpoints are saved through one.

    Returns:
        the first such exception found, else None.
    """
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_ROOM_ERRNOS:
            name = e.filename if isinstance(e.filename, str) else None
            return NoRoom(name, e.strerror or os.strerror(e.errno))
        text = str(e)
        for words, number in NO_ROOM_TEXTS.items():
            if words in text:
                return NoRoom(None, os.strerror(number))
        todo += [e.__cause__, e.__context__]
    return None
