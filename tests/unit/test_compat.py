"""Compatibility checker: one tiny checkpoint per failure mode, valid checkpoints in both formats, and real
Kimi-K2.5 shapes written as a safetensors header over a sparse file."""

from __future__ import annotations

import copy
import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from draftpipe.checks.compat.checker import check
from draftpipe.checks.compat.report import render_markdown

H, NH, NKV, HD, I, V, VD, N = 16, 2, 1, 8, 24, 64, 32, 6
AUX = [1, 3, 5]
VERIFIER = {
    "hidden_size": H,
    "num_attention_heads": NH,
    "num_key_value_heads": NKV,
    "num_hidden_layers": N,
    "vocab_size": V,
    "max_position_embeddings": 256,
    "model_type": "llama",
}


def layer_config(**kw):
    cfg = {
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": HD,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "vocab_size": V,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX},
    }
    cfg.update(kw)
    return cfg


def speculators_config(**kw):
    cfg = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "org/verifier", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer_config(),
        "draft_vocab_size": VD,
        "target_hidden_size": None,
        "norm_before_residual": True,
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": AUX,
    }
    cfg.update(kw)
    return cfg


def tensors(prefix="layers.0.", hd=HD, d2t=True, aux=3):
    z = lambda *s: np.zeros(s, dtype=np.float16)  # noqa: E731
    t = {
        "fc.weight": z(H, aux * H),
        "input_norm.weight": z(aux * H),
        "norm.weight": z(H),
        "embed_tokens.weight": z(V, H),
        "lm_head.weight": z(VD, H),
        prefix + "self_attn.q_proj.weight": z(NH * hd, 2 * H),
        prefix + "self_attn.k_proj.weight": z(NKV * hd, 2 * H),
        prefix + "self_attn.v_proj.weight": z(NKV * hd, 2 * H),
        prefix + "self_attn.o_proj.weight": z(H, NH * hd),
        prefix + "mlp.gate_proj.weight": z(I, H),
        prefix + "mlp.up_proj.weight": z(I, H),
        prefix + "mlp.down_proj.weight": z(H, I),
        prefix + "input_layernorm.weight": z(H),
        prefix + "hidden_norm.weight": z(H),
        prefix + "post_attention_layernorm.weight": z(H),
    }
    if d2t:
        ids = np.arange(0, 2 * VD, 2, dtype=np.int64)  # every second target id
        t["d2t"] = ids - np.arange(VD, dtype=np.int64)
        mask = np.zeros(V, dtype=bool)
        mask[ids] = True
        t["t2d"] = mask
    return t


def write(path: Path, config: dict, ts: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(ts, str(path / "model.safetensors"))
    return path


def errors(rep):
    return rep.ids("error")


def test_valid_speculators_checkpoint_passes(tmp_path):
    rep = check(
        write(tmp_path / "d", speculators_config(), tensors()),
        VERIFIER,
        expect={"head_dim": HD, "draft_vocab_size": VD, "aux_layer_ids": AUX},
    )
    assert rep.ok, rep.to_dict()["findings"]
    assert rep.format == "speculators" and rep.ids("warning") == []
    e = rep.effective
    assert (e["head_dim"], e["num_aux_hidden_states"], e["draft_vocab_size"], e["target_hidden_size"]) == (HD, 3, VD, H)


def test_valid_eagle_style_checkpoint_passes(tmp_path):
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": HD,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "eagle_aux_hidden_state_layer_ids": AUX,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True},
    }
    ts = tensors(prefix="midlayer.")
    del ts["input_norm.weight"], ts["embed_tokens.weight"]
    rep = check(write(tmp_path / "d", cfg, ts), VERIFIER)
    assert rep.ok, rep.to_dict()["findings"]
    assert rep.format == "eagle" and "names.midlayer" in rep.ids("info")


def mutate_config(**kw):
    def f(cfg, ts):
        cfg.update(kw)

    return f


def mutate_layer(**kw):
    def f(cfg, ts):
        cfg["transformer_layer_config"].update(kw)

    return f


def drop(name):
    def f(cfg, ts):
        del ts[name]

    return f


def add(name, array):
    def f(cfg, ts):
        ts[name] = array

    return f


def rename(old, new):
    def f(cfg, ts):
        ts[new] = ts.pop(old)

    return f


def set_tensor(name, array):
    return add(name, array)


def no_mapping(cfg, ts):
    cfg["draft_vocab_size"] = None
    ts["lm_head.weight"] = np.zeros((V, H), dtype=np.float16)


def head_dim_derived(cfg, ts):
    del cfg["transformer_layer_config"]["head_dim"]  # 16 // 2 = 8 derived ... make weights 12 wide
    for k in ("q_proj", "k_proj", "v_proj"):
        rows = (NH if k == "q_proj" else NKV) * 12
        ts[f"layers.0.self_attn.{k}.weight"] = np.zeros((rows, 2 * H), dtype=np.float16)
    ts["layers.0.self_attn.o_proj.weight"] = np.zeros((H, NH * 12), dtype=np.float16)


def only_top_level_four_ids(cfg, ts):
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3, 5]
    cfg["transformer_layer_config"]["eagle_config"] = {}
    ts["fc.weight"] = np.zeros((H, 4 * H), dtype=np.float16)
    ts["input_norm.weight"] = np.zeros(4 * H, dtype=np.float16)


def wider_draft(cfg, ts):
    cfg["target_hidden_size"] = None  # fc reads verifier-width states: needs target_hidden_size
    cfg["transformer_layer_config"]["hidden_size"] = 2 * H


CASES = [
    # (finding id that must appear, mutation)
    ("format.speculators_model_type", mutate_config(speculators_model_type="eagle")),
    ("format.model_type_top_level", mutate_config(model_type="llama")),
    ("format.layer_model_type", mutate_layer(model_type="qwen2")),
    ("config.hidden_act", mutate_layer(hidden_act="gelu")),
    ("shape.head_dim", mutate_layer(head_dim=16)),
    ("shape.head_dim", head_dim_derived),
    ("names.model_prefix", rename("norm.weight", "model.norm.weight")),
    ("names.verifier_tensor", add("verifier_lm_head.weight", np.zeros((V, H), dtype=np.float16))),
    ("names.unknown", add("layers.0.self_attn.rotary.weight", np.zeros(4, dtype=np.float16))),
    ("names.missing", drop("layers.0.mlp.down_proj.weight")),
    ("names.lm_head_missing", drop("lm_head.weight")),
    ("shape.fc.weight", set_tensor("fc.weight", np.zeros((H, 2 * H), dtype=np.float16))),
    ("shape.lm_head.weight", set_tensor("lm_head.weight", np.zeros((VD + 1, H), dtype=np.float16))),
    ("vocab.d2t_missing", drop("d2t")),
    ("vocab.d2t_forbidden", no_mapping),
    ("vocab.d2t_dtype", set_tensor("d2t", np.zeros(VD, dtype=np.float32))),
    ("vocab.d2t_range", set_tensor("d2t", np.full(VD, V, dtype=np.int64))),
    ("vocab.d2t_order", set_tensor("d2t", (VD - 1) - 2 * np.arange(VD, dtype=np.int64))),  # descending ids
    ("vocab.t2d_count", set_tensor("t2d", np.ones(V, dtype=bool))),
    ("vocab.size", mutate_layer(vocab_size=V * 2)),
    ("hidden.target_hidden_size", wider_draft),
    ("aux.range", mutate_config(eagle_aux_hidden_state_layer_ids=[1, 3, 7])),
    ("aux.duplicate", mutate_config(eagle_aux_hidden_state_layer_ids=[1, 3, 3])),
    ("aux.count", only_top_level_four_ids),
    ("aux.disagree", mutate_config(eagle_aux_hidden_state_layer_ids=[1, 2, 5])),
    ("norm.both", mutate_config(fc_norm=True)),
    ("config.layer_types", mutate_layer(layer_types=[])),
]


@pytest.mark.parametrize("finding,mutation", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_failure_mode_is_an_error(tmp_path, finding, mutation):
    cfg, ts = speculators_config(), tensors()
    cfg = copy.deepcopy(cfg)
    mutation(cfg, ts)
    rep = check(write(tmp_path / "d", cfg, ts), VERIFIER)
    assert finding in errors(rep), rep.to_dict()["findings"]
    assert not rep.ok


def test_warnings_for_silent_problems(tmp_path):
    cfg, ts = speculators_config(), tensors()
    ts["layers.0.self_attn.q_proj.bias"] = np.zeros(NH * HD, dtype=np.float16)
    del cfg["norm_before_residual"]
    cfg["speculators_config"]["verifier"] = {}
    cfg["transformer_layer_config"]["max_position_embeddings"] = 128
    ts["d2t"] = ts["d2t"].astype(np.int32)
    rep = check(write(tmp_path / "d", cfg, ts), VERIFIER)
    assert rep.ok
    assert set(rep.ids("warning")) >= {
        "names.bias_without_flag",
        "norm.before_residual_default",
        "format.verifier_name",
        "vocab.d2t_dtype",
        "config.max_position_embeddings",  # 128 < the verifier's 256 (vLLM #48894)
    }


def test_a_draft_context_shorter_than_the_served_one_warns(tmp_path):
    d = write(tmp_path / "d", speculators_config(), tensors())  # 256 tokens, as the verifier's own
    assert "config.max_position_embeddings" not in check(d, VERIFIER, expect={"max_model_len": 256}).ids()
    [f] = [f for f in check(d, VERIFIER, expect={"max_model_len": 1024}).findings
           if f.id == "config.max_position_embeddings"]  # fmt: skip
    assert (f.severity, f.expected, f.found) == ("warning", 1024, 256)


def test_missing_aux_ids_fall_back_to_vllm_default(tmp_path):
    cfg = speculators_config()
    del cfg["eagle_aux_hidden_state_layer_ids"]
    cfg["transformer_layer_config"]["eagle_config"] = {}
    rep = check(write(tmp_path / "d", cfg, tensors()), dict(VERIFIER, num_hidden_layers=32))
    assert "aux.missing" in rep.ids("warning")  # falls back to (2, 16, 29)
    shallow = dict(VERIFIER, num_hidden_layers=5)  # (2, 2, 2): only one distinct layer
    rep = check(tmp_path / "d", shallow)
    assert "aux.missing" in errors(rep)


def test_v2_runner_warning_when_ids_only_in_eagle_config(tmp_path):
    cfg = speculators_config()
    del cfg["eagle_aux_hidden_state_layer_ids"]
    rep = check(write(tmp_path / "d", cfg, tensors()), VERIFIER)
    assert "aux.v2_runner" in rep.ids("warning")


def test_unregistered_eagle_architecture(tmp_path):
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": H,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": HD,
        "intermediate_size": I,
        "num_hidden_layers": 1,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX},
        "eagle_aux_hidden_state_layer_ids": AUX,
    }
    ts = tensors(prefix="midlayer.")
    del ts["input_norm.weight"]
    rep = check(write(tmp_path / "d", cfg, ts), VERIFIER)
    assert "arch.unregistered" in errors(rep)


def test_unreadable_checkpoints_are_findings(tmp_path):
    d = write(tmp_path / "d", speculators_config(), tensors())
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    [finding] = check(d, VERIFIER).errors
    assert (finding.id, finding.field) == ("files.unreadable", "model.safetensors") and "truncated" in finding.message
    [finding] = check(tmp_path / "empty", VERIFIER).errors
    assert (finding.id, finding.field) == ("files.unreadable", "config.json")


def test_report_renders_for_a_person(tmp_path):
    cfg = speculators_config()
    cfg["transformer_layer_config"]["head_dim"] = 16
    rep = check(write(tmp_path / "d", cfg, tensors()), VERIFIER)
    md = render_markdown(rep)
    assert md.startswith("# EAGLE-3 compatibility report: FAIL")
    assert "| shape.head_dim | `head_dim` |" in md and "set head_dim: 8" in md


# ---------------------------------------------------------------- Kimi-K2.5 shapes over a sparse file

KIMI = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_hidden_layers": 61,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def sparse_safetensors(path: Path, shapes: dict[str, tuple[list[int], str]], small: dict[str, np.ndarray]) -> None:
    """Write a safetensors header for `shapes` and only the bytes of `small`; the rest is a hole in the file."""
    sizes = {"BF16": 2, "I64": 8, "BOOL": 1}
    header, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        n = int(np.prod(shape)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        base = 8 + len(blob)
        for name, arr in small.items():
            fh.seek(base + header[name]["data_offsets"][0])
            fh.write(arr.tobytes())
        fh.truncate(base + offset)


def kimi_draft(path: Path, head_dim: int, explicit: bool = True) -> Path:
    Hk, nh, nkv, Ik, Vk, Vdk = 7168, 64, 8, 18432, 163840, 32000
    tlc = {
        "model_type": "llama",
        "hidden_size": Hk,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "intermediate_size": Ik,
        "num_hidden_layers": 1,
        "vocab_size": Vk,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]},
    }
    if explicit:
        tlc["head_dim"] = head_dim
    cfg = speculators_config(
        transformer_layer_config=tlc, draft_vocab_size=Vdk, eagle_aux_hidden_state_layer_ids=[2, 30, 58]
    )
    cfg["speculators_config"]["verifier"]["name_or_path"] = "moonshotai/Kimi-K2.5"
    p = "layers.0."
    shapes = {
        "fc.weight": ([Hk, 3 * Hk], "BF16"),
        "input_norm.weight": ([3 * Hk], "BF16"),
        "norm.weight": ([Hk], "BF16"),
        "embed_tokens.weight": ([Vk, Hk], "BF16"),
        "lm_head.weight": ([Vdk, Hk], "BF16"),
        p + "self_attn.q_proj.weight": ([nh * head_dim, 2 * Hk], "BF16"),
        p + "self_attn.k_proj.weight": ([nkv * head_dim, 2 * Hk], "BF16"),
        p + "self_attn.v_proj.weight": ([nkv * head_dim, 2 * Hk], "BF16"),
        p + "self_attn.o_proj.weight": ([Hk, nh * head_dim], "BF16"),
        p + "mlp.gate_proj.weight": ([Ik, Hk], "BF16"),
        p + "mlp.up_proj.weight": ([Ik, Hk], "BF16"),
        p + "mlp.down_proj.weight": ([Hk, Ik], "BF16"),
        p + "input_layernorm.weight": ([Hk], "BF16"),
        p + "hidden_norm.weight": ([Hk], "BF16"),
        p + "post_attention_layernorm.weight": ([Hk], "BF16"),
        "d2t": ([Vdk], "I64"),
        "t2d": ([Vk], "BOOL"),
    }
    ids = np.sort(np.random.default_rng(0).choice(Vk, Vdk, replace=False)).astype(np.int64)
    mask = np.zeros(Vk, dtype=bool)
    mask[ids] = True
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    sparse_safetensors(path / "model.safetensors", shapes, {"d2t": ids - np.arange(Vdk), "t2d": mask})
    return path


def test_kimi_k25_shapes_header_only(tmp_path):
    good = kimi_draft(tmp_path / "hd128", 128)
    size = (good / "model.safetensors").stat().st_size
    assert size > 2 * 1024**3  # an embed_tokens of 163840 x 7168 alone is 2.3 GB ...
    used = (good / "model.safetensors").stat().st_blocks * 512
    assert used < 64 * 1024**2  # ... but the file is a hole: no real data on disk
    t0 = time.perf_counter()
    rep = check(good, KIMI, expect={"head_dim": 128, "draft_vocab_size": 32000, "aux_layer_ids": [2, 30, 58]})
    elapsed = time.perf_counter() - t0
    assert rep.ok, rep.to_dict()["findings"]
    assert elapsed < 1.0
    assert rep.effective["head_dim"] == 128 and rep.effective["verifier_num_layers"] == 61

    # the seeds' mistake: a draft built with head_dim 112 (= 7168 / 64) where the reference draft used 128
    bad = kimi_draft(tmp_path / "hd112", 112)
    rep = check(bad, KIMI, expect={"head_dim": 128})
    assert not rep.ok
    head = [f for f in rep.errors if f.field == "head_dim"]
    assert head and head[0].expected == 128 and head[0].found == 112

    # weights trained with 128 but no head_dim in the config: vLLM derives 7168 / 64 = 112
    implicit = kimi_draft(tmp_path / "implicit", 128, explicit=False)
    rep = check(implicit, KIMI)
    f = next(f for f in rep.errors if f.id == "shape.head_dim")
    assert (f.field, f.expected, f.found) == ("head_dim", 128, 112)


def test_cli_exit_code_and_outputs(tmp_path):
    d = write(tmp_path / "d", speculators_config(), tensors())
    vpath = tmp_path / "verifier.json"
    vpath.write_text(json.dumps(VERIFIER))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftpipe.checks.compat",
            str(d),
            "--verifier",
            str(vpath),
            "--json",
            str(tmp_path / "r.json"),
            "--md",
            str(tmp_path / "r.md"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    cfg = speculators_config()
    cfg["transformer_layer_config"]["head_dim"] = 16
    write(tmp_path / "bad", cfg, tensors())
    out = subprocess.run(
        [sys.executable, "-m", "draftpipe.checks.compat", str(tmp_path / "bad"), "--verifier", str(vpath)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "shape.head_dim" in out.stdout


@pytest.mark.parametrize(
    "records,expected",
    [
        (0, "the live check has no prompt to run: the eval split is empty (prompts.eval_fraction: 0.0)"),
        (
            2,
            "the live check has no prompt to run: none of the 2 eval prompt(s) leaves room for the check's tokens "
            "(completions.too_long)",
        ),
    ],
)
def test_a_live_check_without_prompts_is_skipped_naming_the_key_not_failed(tmp_path, records, expected):
    """Issue 28: prompts.eval_fraction 0.0 gave the live check no prompt, and the report failed with "no draft
    token was accepted ... check aux layer ids" on a sound draft."""
    from draftpipe.checks.compat.live import skip_live_without_prompts
    from draftpipe.checks.compat.report import verdict_line

    rep = check(write(tmp_path / "d", speculators_config(), tensors()), VERIFIER)
    skip_live_without_prompts(rep, records, 0.0)
    assert rep.ok and "live.acceptance" not in rep.ids()
    [warning] = [f for f in rep.findings if f.id == "live.no_prompts"]
    assert warning.severity == "warning" and warning.message == expected
    assert verdict_line(rep).endswith("; live check skipped")
