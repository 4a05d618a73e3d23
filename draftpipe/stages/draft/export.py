"""The exported draft: speculators-format weights and config, with the aux layer ids where each vLLM runner reads
them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from draftpipe.core.io import atomic_path, write_json


def finalize_config(config: dict, aux_ids: list[int], verifier: str) -> dict:
    """Record the verifier in the speculators config and, for an EAGLE-3 draft, write the aux ids where each vLLM
    runner reads them:

    - top-level ``eagle_aux_hidden_state_layer_ids``: copied by vLLM's ``update_eagle3`` and read by the V1 runner
      (``gpu_model_runner.py``) and the V2 runner (``eagle3_utils.py``) to choose the captured layers;
    - ``transformer_layer_config.eagle_config.eagle_aux_hidden_state_layer_ids``: read by ``Eagle3LlamaForCausalLM``
      for the ``fc`` width (otherwise 3, vLLM issue #54526).

    A DFlash draft (``speculators_model_type: dflash``) already holds them where vLLM's ``update_dflash`` reads
    them (``aux_hidden_state_layer_ids``, the ids the hidden states were extracted at): only the verifier is
    recorded.
    """
    config = json.loads(json.dumps(config))
    if config.get("speculators_model_type") == "dflash":
        config.setdefault("speculators_config", {}).setdefault("verifier", {})["name_or_path"] = verifier
        return config
    config["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    layer = config.setdefault("transformer_layer_config", {})
    eagle = dict(layer.get("eagle_config") or {})
    eagle["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    layer["eagle_config"] = eagle
    config.setdefault("speculators_config", {}).setdefault("verifier", {})["name_or_path"] = verifier
    return config


def export_draft(checkpoint_dir: Path, out_model: str, out_config: str, aux_ids: list[int], verifier: str) -> None:
    """Copy a trained checkpoint's weights and its finalized config to the draft artifacts, atomically."""
    config = json.loads((checkpoint_dir / "config.json").read_text())
    with atomic_path(out_model) as tmp:
        shutil.copyfile(checkpoint_dir / "model.safetensors", tmp)
    write_json(out_config, finalize_config(config, aux_ids, verifier))
