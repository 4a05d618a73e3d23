"""Atomic artifact writes: an interrupted writer never leaves a destination file that a rerun would trust."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import REPO

from draftpipe.core.io import atomic_path, read_jsonl, write_json, write_jsonl


def test_exception_leaves_previous_artifact_untouched(tmp_path):
    dest = tmp_path / "a.json"
    write_json(dest, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(dest) as tmp:
            tmp.write_text('{"v": 2')
            raise RuntimeError("crash mid-write")
    assert json.loads(dest.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_sigkill_mid_write_leaves_no_destination(tmp_path):
    dest = tmp_path / "rows.jsonl"
    code = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from draftpipe.core.io import write_jsonl
def rows():
    for i in range(10**6):
        if i == 1000:
            print("started", flush=True)
            time.sleep(60)
        yield {{"i": i}}
write_jsonl({str(dest)!r}, rows())
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not dest.exists()
    leftovers = list(tmp_path.iterdir())
    assert all(p.name.startswith(".rows.jsonl.tmp-") for p in leftovers)


def test_jsonl_roundtrip_and_error_names_line(tmp_path):
    dest = tmp_path / "r.jsonl"
    assert write_jsonl(dest, [{"a": 1}, {"b": "é"}]) == 2
    assert read_jsonl(dest) == [{"a": 1}, {"b": "é"}]
    dest.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2: expected a JSON object"):
        read_jsonl(dest)


SAVE = """
import sys, torch
sys.path.insert(0, {repo!r})
from draftpipe.core.io import save_safetensors
meta = {{f"key{{i:02d}}": str(i * 7) for i in range(24)}}
save_safetensors(sys.argv[1], {{"b": torch.arange(6, dtype=torch.int64), "a": torch.ones(2, 3)}}, meta)
"""


def test_save_safetensors_gives_equal_bytes_across_processes(tmp_path):
    # safetensors serialises __metadata__ from a per-process hash map: two processes writing the same tensors
    # and 24 metadata keys would differ in header bytes without the canonical rewrite
    paths = [tmp_path / f"{i}.safetensors" for i in range(3)]
    for p in paths:
        subprocess.run([sys.executable, "-c", SAVE.format(repo=str(REPO)), str(p)], check=True)
    data = [p.read_bytes() for p in paths]
    assert data[0] == data[1] == data[2]
    n = int.from_bytes(data[0][:8], "little")
    header = json.loads(data[0][8 : 8 + n])
    assert list(header) == ["__metadata__", *[k for k in header if k != "__metadata__"]]
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    import torch
    from safetensors import safe_open

    with safe_open(str(paths[0]), framework="pt") as fh:
        assert fh.metadata() == {f"key{i:02d}": str(i * 7) for i in range(24)}
        assert torch.equal(fh.get_tensor("b"), torch.arange(6, dtype=torch.int64))
        assert torch.equal(fh.get_tensor("a"), torch.ones(2, 3))
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_remove_interrupted_writes_removes_only_the_outputs_temporary_files(tmp_path):
    from draftpipe.core.io import remove_interrupted_writes

    names = [
        "a[1].jsonl",
        ".a[1].jsonl.tmp-k3j",
        ".a[1].jsonl.tmp-link-42",
        ".b.jsonl.tmp-zz",
        "a[1].jsonl.tmp-no",
        ".a1.jsonl.tmp-glob",
    ]
    for n in names:
        (tmp_path / n).write_text("x")
    removed = remove_interrupted_writes([tmp_path / "a[1].jsonl", tmp_path / "missing" / "c.json"])
    assert sorted(p.name for p in removed) == [".a[1].jsonl.tmp-k3j", ".a[1].jsonl.tmp-link-42"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {p.name for p in removed})
    # a directory artifact: its build directory and a replaced directory not yet deleted
    (tmp_path / "verifier").mkdir()
    for left in (".verifier.tmp-ab12", ".verifier.old-cd34"):
        (tmp_path / left).mkdir()
        (tmp_path / left / "model.safetensors").write_text("x")
    removed = remove_interrupted_writes([tmp_path / "verifier"])
    assert sorted(p.name for p in removed) == [".verifier.old-cd34", ".verifier.tmp-ab12"]
    assert (tmp_path / "verifier").is_dir() and not (tmp_path / ".verifier.tmp-ab12").exists()


def test_atomic_dir_replaces_only_when_complete(tmp_path):
    from draftpipe.core.io import atomic_dir

    dest = tmp_path / "model"
    with atomic_dir(dest) as tmp:
        (tmp / "a.txt").write_text("v1")
    assert (dest / "a.txt").read_text() == "v1"
    with pytest.raises(RuntimeError):
        with atomic_dir(dest) as tmp:
            (tmp / "a.txt").write_text("v2, half")
            raise RuntimeError("killed")
    assert (dest / "a.txt").read_text() == "v1"  # the failed build left the old directory as it was
    with atomic_dir(dest) as tmp:
        (tmp / "b.txt").write_text("v3")
    assert sorted(p.name for p in dest.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no .tmp-/.old- directory left
    assert dest.stat().st_mode & 0o777 == 0o777 & ~_umask()


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_no_room_finds_a_full_disk_in_the_errors_the_writers_raise():
    """Issue 45: a disk full during training said ``basic_ios::clear: iostream error`` and during extraction showed
    ENOSPC only inside vLLM's traceback. ``/dev/full`` fails every write with ENOSPC, as a full file system does."""
    import errno

    import torch
    from safetensors import SafetensorError

    from draftpipe.core.io import NoRoom, no_room

    with pytest.raises(OSError) as plain:
        with open("/dev/full", "wb") as fh:
            fh.write(b"x" * 10_000)
    assert plain.value.errno == errno.ENOSPC
    assert no_room(plain.value) == NoRoom(None, "No space left on device")
    with pytest.raises(OSError) as opened:
        os.open("/dev/full", os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # EEXIST: not a full disk
    assert no_room(opened.value) is None

    state = {"w": torch.zeros(4096)}
    with pytest.raises(RuntimeError) as by_path:  # torch's own file writer: no errno anywhere
        torch.save(state, "/dev/full")
    assert no_room(by_path.value) is None
    with open("/dev/full", "wb", buffering=0) as fh, pytest.raises((OSError, RuntimeError)) as by_file:  # as trainer.py
        torch.save(state, fh)
    assert no_room(by_file.value) == NoRoom(None, "No space left on device")

    # safetensors' Rust writer (save_file, save_pretrained): the text measured on a full tmpfs
    rust = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert no_room(rust) == NoRoom(None, "No space left on device")
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "results/x.jsonl")
    try:
        try:
            raise quota
        except OSError as exc:
            raise RuntimeError("EngineCore failed") from exc
    except RuntimeError as wrapped:
        assert no_room(wrapped) == NoRoom("results/x.jsonl", "Disk quota exceeded")
    assert no_room(RuntimeError("unexpected pos 576 vs 534")) is None
