"""Atomic artifact writes: an interrupted writer never leaves a destination file that a rerun would trust."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from draftpipe.io import atomic_path, read_jsonl, write_json, write_jsonl

from conftest import REPO


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
from draftpipe.io import write_jsonl
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
