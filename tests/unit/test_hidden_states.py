"""Hidden-state shards: vLLM's aux-layer convention, equality with the verifier's own states, shard I/O and
shard validation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.oracle import build_sample, capture_layers, load_verifier_model

from draftpipe.formats.hidden_states import (
    ShardError,
    check_shard_header,
    default_aux_layer_ids,
    dequantize_sample,
    iter_shard,
    quantize_sample,
    read_shard_metadata,
    resolve_aux_layer_ids,
    validate_shard,
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


def synthetic_samples(lengths, hidden=64, aux=3, dtype=torch.bfloat16, seed=0):
    """Samples with the shapes and dtypes build_sample produces, random values (no model needed)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in lengths:
        mask = torch.zeros(t, dtype=torch.uint8)
        mask[t // 2 :] = 1
        out.append(
            {
                "input_ids": torch.randint(0, 512, (t,), generator=g),
                "loss_mask": mask,
                "hidden_states": torch.randn(t, aux * hidden, generator=g).to(dtype),
                "verifier_last_hidden_states": torch.randn(t, hidden, generator=g).to(dtype),
            }
        )
    return out


def write_synthetic(path: Path, lengths=(5, 7, 3), samples=None) -> Path:
    write_shard(str(path), samples or synthetic_samples(lengths), {"aux_layer_ids": [1, 2, 4], "hidden_size": 64})
    return path


def header_of(path: Path) -> tuple[dict, int]:
    """(tensor entries, byte offset where tensor data starts) of a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    return header, 8 + n


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def test_good_shard_passes_and_records_its_token_count(tmp_path):
    path = write_synthetic(tmp_path / "good.safetensors", lengths=(5, 7, 3))
    assert check_shard_header(str(path)) is None
    validate_shard(str(path))
    validate_shard(str(path), aux_layers=3, hidden_size=64)
    meta = read_shard_metadata(str(path))
    assert meta["num_samples"] == 3 and meta["num_tokens"] == 15


def test_truncation_at_any_cut_is_named(tmp_path):
    good = write_synthetic(tmp_path / "good.safetensors")
    data = good.read_bytes()
    header, start = header_of(good)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    cuts = {
        "empty": 0,
        "inside the length": 5,
        "after the length": 8,
        "inside the header": start - 40,
        "no tensor data": start,
        "inside the data": start + 100,
        "last byte missing": len(data) - 1,
    }
    for where, cut in cuts.items():
        path = tmp_path / f"cut{cut}.safetensors"
        path.write_bytes(data[:cut])
        reason = check_shard_header(str(path))
        assert reason is not None and reason.startswith("truncated"), (where, reason)
        with pytest.raises(ShardError, match=rf"cut{cut}\.safetensors: truncated"):
            validate_shard(str(path))
    assert last in check_shard_header(str(tmp_path / f"cut{len(data) - 1}.safetensors"))
    (tmp_path / "longer.safetensors").write_bytes(data + b"\0\0")
    assert check_shard_header(str(tmp_path / "longer.safetensors")) == "2 trailing bytes after the last tensor"


def test_garbage_headers_are_named(tmp_path):
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    assert "header length 1000000000000 is not sane" in check_shard_header(str(huge))
    not_json = tmp_path / "notjson.safetensors"
    not_json.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    assert check_shard_header(str(not_json)).startswith("header is not valid JSON")
    assert check_shard_header(str(tmp_path / "absent.safetensors")).startswith("unreadable")


def test_non_finite_and_out_of_range_values_name_the_tensor(tmp_path):
    good = write_synthetic(tmp_path / "good.safetensors")
    header, start = header_of(good)
    cases = [  # (tensor, byte offset of the element inside it, bytes, expected message)
        ("000001.hidden_states", 2 * 7, b"\xc0\x7f", "1 non-finite values"),  # bfloat16 NaN
        ("000002.verifier_last_hidden_states", 0, b"\x80\xff", "1 non-finite values"),  # bfloat16 -Inf
        ("000000.loss_mask", 1, b"\x02", "1 values other than 0 and 1"),
        ("000002.input_ids", 8, b"\xff" * 8, "1 negative token ids"),  # int64 -1
    ]
    for key, at, raw, message in cases:
        path = tmp_path / f"bad_{key}.safetensors"
        shutil.copyfile(good, path)
        overwrite(path, start + header[key]["data_offsets"][0] + at, raw)
        assert check_shard_header(str(path)) is None  # values are beyond the header check
        with pytest.raises(ShardError, match=rf"bad_{key}\.safetensors: {key}: {message}"):
            validate_shard(str(path))


def test_missing_tensor_and_inconsistent_shapes_are_named(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    good = write_synthetic(tmp_path / "good.safetensors")
    with safe_open(str(good), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    del tensors["000001.loss_mask"]
    missing = tmp_path / "missing.safetensors"
    save_file(tensors, str(missing), metadata=meta)
    assert check_shard_header(str(missing)) == "missing tensors ['000001.loss_mask']"
    with pytest.raises(ShardError, match=r"missing\.safetensors: missing tensors \['000001.loss_mask'\]"):
        validate_shard(str(missing))

    samples = synthetic_samples((4, 6))
    samples[1]["loss_mask"] = torch.ones(7, dtype=torch.uint8)
    ragged = write_synthetic(tmp_path / "ragged.safetensors", samples=samples)
    assert check_shard_header(str(ragged)) == (
        "sample 1: sequence lengths differ (input_ids 6, loss_mask 7, hidden_states 6, verifier_last_hidden_states 6)"
    )

    path = write_synthetic(tmp_path / "aux.safetensors", lengths=(3,))
    assert check_shard_header(str(path), aux_layers=4) == "000000.hidden_states: width 192, expected 4 aux layers x 64"
    with pytest.raises(ShardError, match="expected hidden size 128"):
        validate_shard(str(path), hidden_size=128)

    meta = {**meta, "num_tokens": "99"}
    save_file(
        {k: v for k, v in tensors.items() if k.startswith("000000.")},
        str(tmp_path / "count.safetensors"),
        metadata={**meta, "num_samples": "1"},
    )
    assert check_shard_header(str(tmp_path / "count.safetensors")) == (
        "5 tokens in the tensors but the metadata records num_tokens=99"
    )


def test_header_check_over_a_thousand_shards(tmp_path):
    good = write_synthetic(tmp_path / "good.safetensors", lengths=(4, 4))
    paths = []
    for i in range(1000):
        paths.append(tmp_path / f"train_{i:05d}.safetensors")
        shutil.copyfile(good, paths[-1])
    data = good.read_bytes()
    paths[500].write_bytes(data[:-10])
    reasons = {p.name: check_shard_header(str(p)) for p in paths}
    bad = {name: r for name, r in reasons.items() if r is not None}
    assert list(bad) == ["train_00500.safetensors"] and bad["train_00500.safetensors"].startswith("truncated")


def test_a_damaged_shard_is_quarantined_with_its_store_entry_and_named(tmp_path, monkeypatch):
    from draftpipe.runtime.integrity import require_sound_shards

    monkeypatch.chdir(tmp_path)
    results, store = Path("results"), Path("results/.store/hidden_states")
    store.mkdir(parents=True)
    (results / "hidden_states").mkdir()
    shards = []
    for i in range(2):  # as the stage leaves them: each output a hard link to its store entry
        entry = write_synthetic(store / f"{i:05d}.{'ab' * 16}.safetensors", samples=synthetic_samples((4, 6), seed=i))
        out = results / "hidden_states" / f"train_{i:05d}.safetensors"
        out.hardlink_to(entry)
        shards.append(str(out))
    cache = ".snakemake/draftpipe/shard_values.json"
    require_sound_shards(shards, results, cache)  # sound: nothing happens, both remembered
    assert sorted(json.loads(Path(cache).read_text())) == shards

    header, start = header_of(Path(shards[1]))
    overwrite(Path(shards[1]), start + header["000001.hidden_states"]["data_offsets"][0], b"\xc0\x7f")
    with pytest.raises(ShardError) as err:
        require_sound_shards(shards, results, cache)
    msg = str(err.value)
    assert msg.startswith(
        "1 damaged hidden-state shard(s), not trained on:\n"
        "results/hidden_states/train_00001.safetensors: 000001.hidden_states: 1 non-finite values "
        "(NaN or Inf); moved to results/.quarantine/"
    )
    assert msg.endswith("\nrun snakemake again: it rebuilds them")
    assert not Path(shards[1]).exists() and Path(shards[0]).exists()
    assert [p.name for p in store.glob("00001.*")] == []  # the damaged entry is not linked again
    assert len(list(store.glob("00000.*"))) == 1
    [moved] = (results / ".quarantine").glob("*/hidden_states/train_00001.safetensors")
    assert check_shard_header(str(moved)) is None  # moved intact, for inspection


def test_float8_shard_holds_scaled_states_in_about_half_the_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    # aux layers of very different magnitude: one scale per token and layer keeps the small one exact enough
    samples = []
    for t in (5, 7, 3):
        aux = torch.randn(t, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)
        samples.append(
            {
                "input_ids": torch.arange(t),
                "loss_mask": torch.ones(t, dtype=torch.uint8),
                "hidden_states": aux.reshape(t, -1),
                "verifier_last_hidden_states": torch.randn(t, 64, generator=g),
            }
        )
    fp8 = write_synthetic(tmp_path / "fp8.safetensors", samples=[quantize_sample(s, "float8_e4m3fn") for s in samples])
    bf16 = write_synthetic(tmp_path / "bf16.safetensors", samples=[quantize_sample(s, "bfloat16") for s in samples])
    assert check_shard_header(str(fp8)) is None
    validate_shard(str(fp8), aux_layers=3, hidden_size=64)
    header, _ = header_of(fp8)
    assert header["000001.hidden_states"]["dtype"] == "F8_E4M3"
    assert header["000001.hidden_states_scales"] == {
        **header["000001.hidden_states_scales"],
        "dtype": "F32",
        "shape": [7, 3],
    }
    assert header["000001.verifier_last_hidden_states_scales"]["shape"] == [7, 1]

    def state_bytes(path):
        entries = header_of(path)[0].items()
        return sum(e - b for name, (b, e) in ((n, v["data_offsets"]) for n, v in entries) if "hidden_states" in name)

    # per token and layer: H fp8 values and a float32 scale against 2H bytes of bfloat16
    assert state_bytes(fp8) / state_bytes(bf16) == (64 + 4) / (2 * 64)
    for stored, original in zip(iter_shard(str(fp8)), samples):
        restored = dequantize_sample(stored)
        assert set(restored) == set(original) and restored["hidden_states"].dtype == torch.float32
        for key in ("hidden_states", "verifier_last_hidden_states"):
            t = original[key].shape[0]
            err = (restored[key] - original[key]).reshape(t, -1, 64).abs().amax(dim=(0, 2))
            top = original[key].reshape(t, -1, 64).abs().amax(dim=(0, 2))
            assert (err <= top / 16).all(), (key, err, top)  # e4m3: 3 mantissa bits, half an ulp is 1/16
            assert (err > 0).any()  # it is quantized
    plain = next(iter_shard(str(bf16)))
    assert set(plain) == {"input_ids", "loss_mask", "hidden_states", "verifier_last_hidden_states"}
    assert dequantize_sample(plain, torch.float32)["hidden_states"].dtype == torch.float32


def test_float8_shard_without_its_scales_or_with_bad_scales_is_named(tmp_path):
    good = quantize_sample(synthetic_samples((4,))[0], "float8_e4m3fn")
    no_scales = {k: v for k, v in good.items() if k != "hidden_states_scales"}
    assert "000000.hidden_states_scales: missing" in check_shard_header(
        str(write_synthetic(tmp_path / "a.safetensors", samples=[no_scales]))
    )
    wrong_shape = {**good, "hidden_states_scales": good["hidden_states_scales"][:, :2].contiguous()}
    assert "expected F32 [4, 3]" in check_shard_header(
        str(write_synthetic(tmp_path / "b.safetensors", samples=[wrong_shape]))
    )
    zero = {**good, "verifier_last_hidden_states_scales": torch.zeros(4, 1)}
    path = write_synthetic(tmp_path / "c.safetensors", samples=[zero])
    with pytest.raises(ShardError, match="verifier_last_hidden_states_scales: 4 scales that are not finite"):
        validate_shard(str(path))
    with pytest.raises(ValueError, match="hidden_states.dtype: 'int8'"):
        quantize_sample(good, "int8")


def test_a_header_nested_past_any_limit_is_named_not_raised(tmp_path):
    """Issue 28: a shard header nested 100,000 levels deep is a damaged shard (quarantined like any other), not
    a RecursionError that breaks every later parse of the workflow."""
    deep = tmp_path / "deep.safetensors"
    header = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    deep.write_bytes(len(header).to_bytes(8, "little") + header)
    assert check_shard_header(str(deep)) == "header refused (JSON nested more than 64 levels deep)"
    with pytest.raises(ShardError, match="header refused"):
        validate_shard(str(deep))
