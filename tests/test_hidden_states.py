"""Hidden-state shards: vLLM's aux-layer convention, equality with the verifier's own states, shard I/O."""

from __future__ import annotations

import pytest
import torch

from draftpipe.hidden_states import (
    ShardError,
    build_sample,
    capture_layers,
    default_aux_layer_ids,
    iter_shard,
    load_verifier_model,
    read_shard_metadata,
    resolve_aux_layer_ids,
    write_shard,
)


@pytest.fixture(scope="module")
def model(verifier_dir):
    return load_verifier_model(str(verifier_dir), "float32")


def test_default_ids_follow_vllm_and_reject_shallow_verifiers():
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(61) == [2, 30, 58]  # Kimi-K2.5
    with pytest.raises(ValueError, match="5 layers"):
        default_aux_layer_ids(5)
    assert resolve_aux_layer_ids([4, 1, 2], 5) == [1, 2, 4]
    with pytest.raises(ValueError, match="outside"):
        resolve_aux_layer_ids([1, 6], 5)
    with pytest.raises(ValueError, match="repeat"):
        resolve_aux_layer_ids([2, 2, 3], 5)


def test_captured_states_equal_the_verifiers_own(model):
    ids = torch.tensor([1, 403, 407, 261, 378, 267, 300, 290])
    with torch.no_grad():
        out = model(input_ids=ids.unsqueeze(0), output_hidden_states=True)
    n = model.config.num_hidden_layers
    got = capture_layers(model, ids, [0, 1, 2, 4, n])
    # id k < N is Hugging Face hidden_states[k] (the state entering layer k; id 0 = embeddings)
    for k in (0, 1, 2, 4):
        assert torch.equal(got[k], out.hidden_states[k][0]), k
    # id N is the final *pre-norm* state: HF's last entry is post-norm, and the logits come from it
    assert not torch.allclose(got[n], out.hidden_states[n][0])
    normed = model.model.norm(got[n].unsqueeze(0))
    assert torch.allclose(normed[0], out.hidden_states[n][0], atol=1e-6)
    assert torch.allclose(model.lm_head(normed)[0], out.logits[0], atol=1e-5)


def test_sample_layout_and_shard_roundtrip(model, tmp_path):
    row = {"prompt_token_ids": [1, 403, 407], "completion_token_ids": [261, 378, 267, 300]}
    s = build_sample(model, row, [1, 2, 4], 5, max_len=6, dtype=torch.bfloat16)
    assert s["input_ids"].tolist() == [1, 403, 407, 261, 378, 267]
    assert s["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1]
    assert s["hidden_states"].shape == (6, 3 * 64) and s["hidden_states"].dtype == torch.bfloat16
    assert s["verifier_last_hidden_states"].shape == (6, 64)
    states = capture_layers(model, s["input_ids"], [1, 2, 4])
    assert torch.equal(s["hidden_states"][:, 64:128], states[2].to(torch.bfloat16))
    path = tmp_path / "shard.safetensors"
    write_shard(str(path), [s, {k: v.clone() for k, v in s.items()}], {"aux_layer_ids": [1, 2, 4], "hidden_size": 64})
    meta = read_shard_metadata(str(path))
    assert meta["num_samples"] == 2 and meta["aux_layer_ids"] == [1, 2, 4]
    back = list(iter_shard(str(path)))
    assert len(back) == 2 and all(torch.equal(back[1][k], s[k]) for k in s)


def test_truncated_shard_is_detected(model, tmp_path):
    row = {"prompt_token_ids": [1, 403], "completion_token_ids": [407, 261]}
    s = build_sample(model, row, [1, 2, 4], 5, max_len=16, dtype=torch.bfloat16)
    path = tmp_path / "shard.safetensors"
    write_shard(str(path), [s], {"aux_layer_ids": [1, 2, 4]})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match="shard.safetensors"):
        read_shard_metadata(str(path))
