"""Verifier identity: what reaches `params:` changes with the verifier's content (weights, tokenizer, chat template)
and only with it; file digests are read once per file version."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import draftpipe.core.io as dio
from draftpipe.core.io import cached_sha256
from draftpipe.workflow.identity import model_dir_template_hash, verifier_identity


def _no_reads(monkeypatch):
    def refuse(path, *a, **k):
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(dio, "sha256_file", refuse)


def test_cached_sha256_reads_each_file_version_once(tmp_path, monkeypatch):
    f, cache = tmp_path / "w.bin", tmp_path / "cache" / "hashes.json"
    f.write_bytes(b"weights v1")
    first = cached_sha256(f, cache)
    assert first == hashlib.sha256(b"weights v1").hexdigest()
    with monkeypatch.context() as m:
        _no_reads(m)
        assert cached_sha256(f, cache) == first  # unchanged stat: from the cache
    os.utime(f, ns=(1, 1))  # a touch: read again, same digest
    assert cached_sha256(f, cache) == first
    f.write_bytes(b"weights v2")
    assert cached_sha256(f, cache) == hashlib.sha256(b"weights v2").hexdigest()
    cache.write_text("{not json")  # a damaged cache is ignored and rewritten
    assert cached_sha256(f, cache) == hashlib.sha256(b"weights v2").hexdigest()
    assert json.loads(cache.read_text())[str(f.resolve())]["sha256"] == hashlib.sha256(b"weights v2").hexdigest()


def test_a_hub_cache_blob_is_named_by_its_digest(tmp_path, monkeypatch):
    digest = hashlib.sha256(b"lfs weights").hexdigest()
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / digest).write_bytes(b"lfs weights")
    (tmp_path / "snapshots" / "abc123").mkdir(parents=True)
    link = tmp_path / "snapshots" / "abc123" / "model.safetensors"
    link.symlink_to(tmp_path / "blobs" / digest)
    _no_reads(monkeypatch)
    assert cached_sha256(link, None) == digest


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "verifier"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (d / "model-00001-of-00002.safetensors").write_bytes(b"a" * 64)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"b" * 64)
    (d / "model.safetensors.index.json").write_text("{}")
    (d / "README.md").write_text("not part of the model")
    return d


def _identity(d: Path, cache: Path) -> dict:
    return verifier_identity({"kind": "local", "path": str(d)}, {"verifier": {}}, cache)


def test_local_verifier_identity_follows_content(model_dir, tmp_path):
    cache = tmp_path / "hashes.json"
    base = _identity(model_dir, cache)
    assert sorted(base["files"]) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer_config.json",
    ]
    assert base["chat_template_sha256"] == hashlib.sha256(b"{{ messages }}").hexdigest()
    assert base["files"]["model-00002-of-00002.safetensors"] == hashlib.sha256(b"b" * 64).hexdigest()

    for p in model_dir.iterdir():  # touching every file, editing an unrelated one: the same identity
        os.utime(p, ns=(5, 5))
    (model_dir / "README.md").write_text("edited")
    assert _identity(model_dir, cache) == base

    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages | tojson }}"}))
    changed = _identity(model_dir, cache)
    assert changed["chat_template_sha256"] != base["chat_template_sha256"]
    assert changed["files"]["tokenizer_config.json"] != base["files"]["tokenizer_config.json"]

    (model_dir / "chat_template.jinja").write_text("{{ messages }}")  # takes precedence, as in transformers
    assert model_dir_template_hash(model_dir) == hashlib.sha256(b"{{ messages }}").hexdigest()

    (model_dir / "model-00002-of-00002.safetensors").write_bytes(b"c" * 64)  # fine-tuned: same size, new bytes
    assert (
        _identity(model_dir, cache)["files"]["model-00002-of-00002.safetensors"]
        == hashlib.sha256(b"c" * 64).hexdigest()
    )


def test_a_copy_of_the_verifier_has_the_same_content_identity(model_dir, tmp_path):
    copy = tmp_path / "elsewhere" / "verifier"
    shutil.copytree(model_dir, copy)
    a, b = _identity(model_dir, tmp_path / "h.json"), _identity(copy, tmp_path / "h.json")
    assert a["files"] == b["files"] and a["chat_template_sha256"] == b["chat_template_sha256"]
    assert a["path"] != b["path"]


def test_hub_identity_records_the_snapshot_commit(model_dir, tmp_path):
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snap)
    ident = verifier_identity(
        {"kind": "hub", "id": "org/m", "config_path": str(snap / "config.json")},
        {"verifier": {"revision": None}},
        tmp_path / "h.json",
    )
    assert ident["hub_id"] == "org/m" and ident["commit"] == "0123abcd"
    assert ident["files"] == _identity(model_dir, tmp_path / "h.json")["files"]
    planned = verifier_identity(
        {"kind": "hub", "id": "org/m", "config_path": str(tmp_path / "cfg.json")},
        {"verifier": {"revision": "v1"}},
        None,
    )
    assert planned == {"hub_id": "org/m", "revision": "v1"}


def test_gguf_identity_is_the_files_digest(tmp_path):
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF....")
    ident = verifier_identity(
        {"kind": "gguf", "path": str(g)}, {"verifier": {"gguf_head_dim": 32}}, tmp_path / "h.json"
    )
    assert ident == {
        "gguf_sha256": hashlib.sha256(b"GGUF....").hexdigest(),
        "head_dim": 32,
        "max_position_embeddings": None,
    }
