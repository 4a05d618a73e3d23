"""Typed config fields: every value the check reads has the type vLLM's loader needs, else a ``config.type`` finding
and the value is left out (the check never fails on a value of the wrong type)."""

from __future__ import annotations

import json
from typing import Any

from draftpipe.checks.compat.report import Report
from draftpipe.core.io import tensor_entry_problem

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
            expected="an object",
            found=type(config).__name__,
            fix="write the config as a JSON object",
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
                    expected=_type_name(kind) + (" or null" if nullable else ""),
                    found=why,
                    fix=f"set {where}{key} to {_type_name(kind)}",
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
                expected="dtype, shape and data_offsets of the safetensors format",
                found=why,
                fix="save the draft again with safetensors",
            )
    return out
