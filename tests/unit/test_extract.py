"""Hidden-state extraction without an engine: the layer ids vLLM is asked for, token-bounded calls, the KV cache bytes
per token of a Kimi-sized verifier, and the connector's transfer config."""

from __future__ import annotations

import pytest

from draftpipe.formats.captured import engine_layer_ids
from draftpipe.stages.extract import batches, cache_bytes_per_token, kv_transfer_config


def test_engine_layer_ids_sorted_distinct_with_last():
    assert engine_layer_ids([4, 1, 2], 5) == [1, 2, 4, 5]
    assert engine_layer_ids([2, 5], 5) == [2, 5]  # the last state as an aux id is captured once
    assert engine_layer_ids([2, 30, 58], 61) == [2, 30, 58, 61]
    with pytest.raises(ValueError, match=r"outside \[0, 5\]"):
        engine_layer_ids([1, 7], 5)


def test_batches_bound_tokens_per_call():
    assert [list(r) for r in batches([3, 3, 3, 10, 1], 6)] == [[0, 1], [2], [3], [4]]
    assert [list(r) for r in batches([5, 5], 1)] == [[0], [1]]
    assert list(batches([], 8)) == []


def test_cache_bytes_per_token_kimi():
    # Kimi-K2.5: 3 aux ids + the last state, hidden 7168, bfloat16: 57,344 bytes per token on every GPU
    assert cache_bytes_per_token(3, 7168) == 57344


def test_kv_transfer_config_names_the_package_connector(tmp_path):
    cfg = kv_transfer_config(tmp_path)
    assert cfg["kv_connector"] == "DraftpipeHiddenStatesConnector"
    assert cfg["kv_connector_module_path"] == "draftpipe.inference.connector"
    assert cfg["kv_connector_extra_config"] == {"shared_storage_path": str(tmp_path), "allow_custom_save_path": True}


def test_a_request_file_is_waited_for_while_the_connector_holds_its_lock(tmp_path):
    """The connector holds ``<file>.lock`` exclusively from the request's arrival until its file is written; an
    in-process engine must be stepped until then (:func:`flush_saves`), so the lock is tested without waiting."""
    import fcntl
    import os

    from draftpipe.stages.extract import _lock_held

    path = str(tmp_path / "00000000.safetensors")
    assert not _lock_held(path)  # no lock file: nothing to wait for
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert _lock_held(path)  # the writer's lock, from another open file description of this process too
    os.close(fd)
    assert not _lock_held(path)
