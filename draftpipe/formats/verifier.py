"""The verifier as the workflow reads it: lookup of ``verifier.path`` (local directory, GGUF or hub cache), its
config, and a GGUF's metadata and the checks that say whether the conversion can take it.

Everything here runs when the Snakefile is parsed, so this module imports neither torch nor transformers; the
GGUF -> Hugging Face conversion itself is :mod:`draftpipe.stages.verifier`. Reference: ``tiny-verifier.md``
(§1-5).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from draftpipe.core.io import load_json_object

__all__ = [
    "BAD_GGUF_METADATA_KEYS",
    "CPU_ATTENTION_HEAD_SIZES",
    "UnsupportedGGUFError",
    "VerifierNotFoundError",
    "check_gguf",
    "gguf_metadata",
    "load_verifier_config",
    "resolve_gguf_head_dim",
    "resolve_verifier",
]

#: GGUF keys that llama.cpp's ``convert-llama2c-to-ggml`` writes as 0xFFFFFFFF ("no such token") and that
#: transformers' GGUF loader uses as vocabulary indices (tiny-verifier.md §2 steps 3-5).
BAD_GGUF_METADATA_KEYS = ("tokenizer.ggml.padding_token_id", "tokenizer.ggml.seperator_token_id")


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
       ``{"kind": "gguf", "path": <normalised path>}``; it needs :func:`draftpipe.stages.verifier.convert_gguf` before vLLM or transformers
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
    obj = load_json_object(cfg.read_text(encoding="utf-8"), str(cfg))
    return text_config(obj) if text else obj


# --------------------------------------------------------------------------------------------------------------
# GGUF metadata fix
# --------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------
# head_dim re-parameterisation
# --------------------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------------------
# GGUF -> Hugging Face directory
# --------------------------------------------------------------------------------------------------------------


#: GGUF architectures :func:`draftpipe.stages.verifier.convert_gguf` converts (``general.architecture``): transformers' Llama loader.
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
    """A GGUF that :func:`draftpipe.stages.verifier.convert_gguf` cannot convert faithfully; the message names the file and the field."""


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
        "license": _gguf_value(reader, "general.license"),
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
        ``architecture`` (``general.architecture``), ``name``, ``license`` (``general.license``), ``tokenizer_model`` (``tokenizer.ggml.model``:
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
    """Refuse a GGUF that :func:`draftpipe.stages.verifier.convert_gguf` would convert wrongly: another architecture than Llama, or a
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
    re-parameterisation (:func:`draftpipe.stages.verifier.reparameterize_head_dim`) places each RoPE pair on a wider head;
    and one of :data:`CPU_ATTENTION_HEAD_SIZES`, else vLLM's engine would refuse the converted verifier at its first
    start (minutes into the completions job).

    Args:
        requested: the configured value, or None.
        model_head_dim: the GGUF's head dim (:func:`gguf_metadata`).
        field: the config key, for messages.

    Returns:
        The head dim to convert to.

    Raises:
        ValueError: ``requested`` is not a multiple of ``model_head_dim`` or not a size vLLM's kernels take, or no
            supported size is (None), naming ``field`` and both values.
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
    if requested not in CPU_ATTENTION_HEAD_SIZES:
        multiples = [d for d in CPU_ATTENTION_HEAD_SIZES if d % model_head_dim == 0]
        raise ValueError(
            f"{field}: {requested} is not a head size vLLM's attention kernels take "
            f"({', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}; vLLM 0.32's CPU backend refuses it at the first "
            f"engine start: 'Unsupported CPU attention configuration'). Use one that is a multiple of the GGUF's "
            f"head_dim {model_head_dim} ({', '.join(map(str, multiples)) or 'none is'}), or null for what the "
            "model needs"
        )
    return requested


def kv_cache_bytes_per_token(verifier_config: dict, dtype_bytes: int = 2, tensor_parallel: int = 1) -> int | None:
    """Bytes of vLLM's KV cache per token on one GPU, from a verifier's ``config.json`` (its ``text_config`` for a
    multimodal wrapper such as Kimi-K2.5's).

    - MLA (DeepSeek-V3 family, ``kv_lora_rank`` set): ``layers x (kv_lora_rank + qk_rope_head_dim) x bytes``, the
      compressed latent that every GPU holds whole (vLLM replicates the MLA cache under tensor parallelism);
    - otherwise: ``layers x 2 x kv_heads x head_dim x bytes / tp`` (K and V, heads sharded over the GPUs; at
      least one head per GPU), ``head_dim`` defaulting to ``hidden_size // num_attention_heads``.

    Returns:
        None when the config lacks the fields.
    """
    cfg = text_config(verifier_config)
    try:
        layers = int(cfg["num_hidden_layers"])
        if is_mla_config(cfg):
            return layers * (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)) * dtype_bytes
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    per_gpu_heads = max(1, -(-kv_heads // max(1, tensor_parallel)))
    return layers * 2 * per_gpu_heads * head_dim * dtype_bytes
