"""Verifiers for tests: any architecture transformers knows, with random weights, from a config.json alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

from draftpipe.core.io import atomic_dir

#: Tokenizer files copied from ``tokenizer_dir`` by :func:`build_random_verifier`.

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def build_random_verifier(
    config_json: str | os.PathLike, out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, seed: int = 0
) -> Path:
    """A verifier of any architecture transformers knows, with random weights, from a ``config.json`` alone.

    For tests of architecture families without downloads (DeepSeek-V3's MLA + MoE, Qwen3's q/k norm and explicit
    ``head_dim``): ``AutoModelForCausalLM.from_config`` under ``torch.manual_seed(seed)`` in float32, saved with
    ``save_pretrained`` into ``out_dir`` (atomically), with the tokenizer files of ``tokenizer_dir`` beside it. The
    same config and seed give the same weights.

    Args:
        config_json: the checked-in config (its ``vocab_size`` must match the tokenizer's).
        out_dir: the Hugging Face directory to write (replaced when it exists).
        tokenizer_dir: a Hugging Face directory whose tokenizer files are copied (:data:`TOKENIZER_FILES`).
        seed: torch seed for the initialisation.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: ``config_json`` is not a JSON object with a ``model_type``.
    """
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(Path(config_json).read_text())
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ValueError(f"{config_json}: expected a config.json object with a model_type")
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg))
        config = AutoConfig.from_pretrained(str(tmp))
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        model.save_pretrained(str(tmp))
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copyfile(src, tmp / name)
    return out
