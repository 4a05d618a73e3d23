"""A real verifier's tokenizer, chat template and GGUF settings: the tokenizer gate refuses a tokenizer that does not
give text back (the broken conversion of a byte-level BPE GGUF: every space lost, ``Ġ``/``Ċ`` never decoded), a GGUF
the conversion cannot take is refused when the workflow is read, and real datasets' nested keys and record caps.
"""

from __future__ import annotations

import json

import pytest
from conftest import GGUF, REPO, TINYSTORIES
from helpers.workflow import copy_workflow, snakemake
from test_bad_input import base_config, jsonl, raised

from draftpipe.core.tokenizer_check import TokenizerGateError, check_decoded, check_round_trip
from draftpipe.formats.prompts import load_prompts
from draftpipe.formats.verifier import CPU_ATTENTION_HEAD_SIZES, gguf_metadata, resolve_gguf_head_dim
from draftpipe.workflow.config import ConfigError, check_config

PROMPTS = REPO / "draftpipe" / "data" / "prompts"
SENTENCES = [
    "Once upon a time, there was a little girl named Lily.",
    "Carlos is planting a lemon tree. The tree will cost $90 to plant.\nEach year it grows 7 lemons.",
]


def byte_level_tokenizer(out, *, broken: bool):
    """A small GPT-2-style byte-level BPE tokenizer (``tokenizer.json``) trained on a few sentences, with a
    ``tokenizer_config.json`` that reads it as the fast tokenizer it is or, ``broken``, as a SentencePiece
    ``LlamaTokenizer`` (``legacy: false``): what the old GGUF conversion wrote for SmolLM2's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES * 20, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    cls = {"tokenizer_class": "LlamaTokenizer", "legacy": False} if broken else {"tokenizer_class": "TokenizersBackend"}
    (out / "tokenizer_config.json").write_text(json.dumps({**special, **cls}))
    return out


def _pairs(texts):
    return [(f"text {i}", t) for i, t in enumerate(texts)]


def test_the_gate_refuses_a_byte_level_vocabulary_read_as_sentencepiece(tmp_path):
    from transformers import AutoTokenizer

    broken = AutoTokenizer.from_pretrained(byte_level_tokenizer(tmp_path / "broken", broken=True))
    msg = raised(TokenizerGateError, check_round_trip, broken, _pairs(SENTENCES), "v.gguf")
    assert msg == (
        "tokenizer gate: the tokenizer of the verifier v.gguf does not give text 0 back (the text differs): "
        "'Once upon a time, there was a little girl named Lily.' came back as "
        "'Onceuponatime,therewasalittlegirlnamedLily.'. Its tokenizer files do not match its vocabulary (for a GGUF, "
        "the conversion lost the tokenizer); no completion was generated"
    )
    good = AutoTokenizer.from_pretrained(byte_level_tokenizer(tmp_path / "good", broken=False))
    assert check_round_trip(good, _pairs(SENTENCES), "v.gguf") == 2


def test_the_gate_passes_the_embedded_default_on_every_shipped_prompt_set(verifier_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier_dir)
    texts = []
    for name, field in (("tinystories_evaluation_prompts.jsonl", "prompt"), ("gsm8k_test.jsonl", "question")):
        with open(PROMPTS / name, encoding="utf-8") as fh:
            texts += [json.loads(line)[field] for line in fh][:300]
    with open(PROMPTS / "mt_bench_question.jsonl", encoding="utf-8") as fh:
        texts += [t for line in fh for t in json.loads(line)["turns"]]
    assert check_round_trip(tok, _pairs(texts), "stories260K") == len(texts) == 504


def test_decoded_text_with_byte_level_markers_is_refused():
    msg = raised(TokenizerGateError, check_decoded, [("row a sample 0", "152ĊĊTheĠanswerĠisĠ152.")], "v")
    assert msg == (
        "tokenizer gate: the verifier v's decoded output row a sample 0 holds 5 byte-level BPE markers (Ġ, Ċ, ĉ: "
        "spaces and newlines never decoded): '152ĊĊTheĠanswerĠisĠ152.'. Its tokenizer's decoder does not match its "
        "vocabulary"
    )
    # plain text, and one marker alone (a character a model may write), pass
    assert check_decoded([("a", "The answer is 152."), ("b", "the letter Ġ")], "v") == 2


def test_the_completions_stage_stops_at_the_gate_before_its_engine(tmp_path, verifier_dir):
    """A verifier directory with the broken tokenizer: the completions job fails naming the verifier and the first
    prompt (file and line), and no completion is written."""
    import shutil

    work = copy_workflow(tmp_path / "wf")
    bad = tmp_path / "broken-verifier"
    shutil.copytree(verifier_dir, bad)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bad / name).unlink()
    byte_level_tokenizer(bad, broken=True)
    cfg = (
        (work / "config.yaml").read_text().replace("path: draftpipe/data/stories260K/stories260K.gguf", f"path: {bad}")
    )
    (work / "config.yaml").write_text(cfg)
    proc = snakemake(work, "results/completions/train_00000.jsonl", check=False)
    assert proc.returncode != 0
    log = (work / "results" / "logs" / "completions" / "train_00000.log").read_text()
    assert f"tokenizer gate: the tokenizer of the verifier {bad} does not give prompt draftpipe/data/prompts/" in log
    assert "tinystories_evaluation_prompts.jsonl:" in log and "(the text differs)" in log
    assert "Loading" not in log.split("tokenizer gate:")[0]  # no engine started before it
    assert not list((work / "results" / "completions").glob("*.jsonl"))


# ------------------------------------------------------------------------------------------------ GGUF settings


def test_gguf_metadata_of_the_embedded_default():
    meta = gguf_metadata(GGUF)
    assert {k: meta[k] for k in ("architecture", "tokenizer_model", "chat_template", "head_dim", "context_length")} == {
        "architecture": "llama",
        "tokenizer_model": "llama",
        "chat_template": None,
        "head_dim": 8,
        "context_length": 2048,
    }
    assert (meta["tensor_types"], meta["quantized"]) == (["F32"], [])


def test_gguf_head_dim_defaults_to_what_the_model_needs():
    assert resolve_gguf_head_dim(None, 8) == 32  # stories260K: no CPU kernel for 8
    assert resolve_gguf_head_dim(None, 64) == 64  # SmolLM2: kept
    assert resolve_gguf_head_dim(None, 48) == 96  # stories15M
    assert resolve_gguf_head_dim(64, 8) == 64
    assert raised(ValueError, resolve_gguf_head_dim, 7, 8) == (
        "verifier.gguf_head_dim: 7 is not a multiple of the GGUF's head_dim 8: the exact re-parameterisation widens "
        "each head by a whole factor. Use a multiple of 8 (with kernels on CPU: 32, 64, 80, 96, 112, 128, 160, 192, "
        "224, 256, 512), or null for what the model needs"
    )
    assert 80 in CPU_ATTENTION_HEAD_SIZES and 8 not in CPU_ATTENTION_HEAD_SIZES
    # a multiple of the model's that vLLM's kernels refuse ("Unsupported CPU attention configuration" at the first
    # engine start) is refused when the workflow is read
    assert raised(ValueError, resolve_gguf_head_dim, 16, 8) == (
        "verifier.gguf_head_dim: 16 is not a head size vLLM's attention kernels take (32, 64, 80, 96, 112, 128, 160, "
        "192, 224, 256, 512; vLLM 0.32's CPU backend refuses it at the first engine start: 'Unsupported CPU attention "
        "configuration'). Use one that is a multiple of the GGUF's head_dim 8 (32, 64, 80, 96, 112, 128, 160, 192, "
        "224, 256, 512), or null for what the model needs"
    )
    assert resolve_gguf_head_dim(32, 8) == 32


def _gguf_config(**verifier) -> dict:
    cfg = base_config()
    cfg["verifier"].update({"max_model_len": 512, "gguf_max_position_embeddings": 512, **verifier})
    return cfg


def test_gguf_settings_are_checked_when_the_workflow_is_read():
    gguf = {"kind": "gguf", "path": str(GGUF)}
    derived = check_config(_gguf_config(gguf_head_dim=None, dtype="auto"), gguf)["gguf"]
    assert derived == {
        "head_dim": 32,
        "max_position_embeddings": 512,
        "dtype": "float32",
        "original_head_dim": 8,
        "tokenizer_model": "llama",
        "chat_template": False,
        "quantized": [],
    }
    assert raised(ConfigError, check_config, _gguf_config(gguf_head_dim=7), gguf).startswith(
        "verifier.gguf_head_dim: 7 is not a multiple of the GGUF's head_dim 8"
    )
    assert raised(ConfigError, check_config, _gguf_config(gguf_head_dim=16), gguf).startswith(
        "verifier.gguf_head_dim: 16 is not a head size vLLM's attention kernels take"
    )
    assert raised(ConfigError, check_config, _gguf_config(chat_template="required"), gguf) == (
        f"verifier.chat_template: 'required', but the GGUF {GGUF} has no chat template (tokenizer.chat_template) and "
        "verifier.chat_template_file is not set"
    )
    assert check_config(_gguf_config(chat_template="required", chat_template_file="tiny_chat"), gguf)["gguf"]


def _write_gguf(path, arch: str, tokenizer_model: str):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(8)
    w.add_context_length(256)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(["<unk>", "<s>", "</s>", "a"])
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "arch,tok,expected",
    [
        (
            "qwen2",
            "gpt2",
            "verifier.path: {p} is a GGUF of architecture 'qwen2' (general.architecture); the conversion takes llama. "
            "Give the model as a Hugging Face directory instead",
        ),
        (
            "llama",
            "t5",
            "verifier.path: {p} has tokenizer model 't5' (tokenizer.ggml.model), which transformers' GGUF loader does "
            "not rebuild (it knows llama, gpt2); give the model as a Hugging Face directory with its tokenizer files "
            "instead",
        ),
    ],
)
def test_a_gguf_the_conversion_cannot_take_is_refused_when_the_workflow_is_read(tmp_path, arch, tok, expected):
    p = _write_gguf(tmp_path / f"{arch}-{tok}.gguf", arch, tok)
    assert raised(ConfigError, check_config, _gguf_config(), {"kind": "gguf", "path": str(p)}) == expected.format(p=p)


# ------------------------------------------------------------------------------------------------ datasets


SEED_TASKS = [  # Alpaca's seed tasks: the task's input is nested in its first instance
    {
        "id": "seed_task_0",
        "name": "breakfast_suggestion",
        "instruction": "Is there anything I can eat for a breakfast that doesn't include eggs?",
        "instances": [{"input": "", "output": "Yes, oatmeal."}],
        "is_classification": False,
    },
    {
        "id": "seed_task_1",
        "name": "antonym_relation",
        "instruction": "What is the relation between the given pairs?",
        "instances": [{"input": "Night : Day :: Right : Left", "output": "Antonyms."}],
        "is_classification": False,
    },
]


def test_nested_keys_a_record_cap_and_the_key_that_holds_ignored_text(tmp_path):
    path = tmp_path / "seed_tasks.jsonl"
    path.write_bytes(jsonl(*SEED_TASKS))
    records, stats = load_prompts([{"path": str(path), "field": "instruction"}])
    assert stats.per_source[str(path)]["ignored_text"] == {"instances.0.input": 1}  # not `name`, a label
    assert "text under 'instances.0.input'" in stats.warnings[0]
    assert "field: [instruction, instances.0.input]" in stats.warnings[0]
    records, stats = load_prompts([{"path": str(path), "field": ["instruction", "instances.0.input"]}])
    assert stats.warnings == []
    assert sorted(r["messages"][0]["content"] for r in records) == [
        "Is there anything I can eat for a breakfast that doesn't include eggs?",
        "What is the relation between the given pairs?\n\nNight : Day :: Right : Left",
    ]
    records, _ = load_prompts([{"path": str(path), "template": "{instruction}\nInput: {instances.0.input}"}])
    assert "What is the relation between the given pairs?\nInput: Night : Day :: Right : Left" in [
        r["messages"][0]["content"] for r in records
    ]
    records, stats = load_prompts([{"path": str(TINYSTORIES), "max_records": 5}])
    assert (len(records), stats.per_source[str(TINYSTORIES)]["read"]) == (5, 5)
    assert [r["line"] for r in sorted(records, key=lambda r: r["line"])] == [1, 2, 3, 4, 5]


def test_the_smollm2_preset_is_a_valid_config():
    from draftpipe.workflow.config import check_config_files

    cfg = check_config_files([REPO / "configs" / "smollm2-135m.yaml"], base=REPO / "config.yaml")
    assert cfg["verifier"]["path"] == ".models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (cfg["verifier"]["gguf_head_dim"], cfg["verifier"]["gguf_max_position_embeddings"]) == (None, None)
    assert (cfg["verifier"]["chat_template"], cfg["completions"]["turns"]) == ("required", "all")
    assert cfg["prompts"]["sources"][1] == {
        "path": "draftpipe/data/prompts/gsm8k_test.jsonl",
        "field": "question",
        "max_records": 240,
    }
