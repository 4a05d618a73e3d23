"""Rule `hidden_states`: aux + last hidden states and loss mask of every sample of a training shard.

The first job of the stage loads the verifier once and fills every stale shard whose completions exist
(draftpipe/stage.py); the others link their result from the stage's store.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime import start_job

start_job(snakemake)  # ML environment, log, this job's GPUs and threads

import torch  # noqa: E402 (after CUDA_VISIBLE_DEVICES is set)

import draftpipe.hidden_states as hs  # noqa: E402
from draftpipe.io import read_jsonl  # noqa: E402
from draftpipe.stage import STORE, code_digest, run_stage, stage_settings, stage_tasks  # noqa: E402

p = snakemake.params


def compute(tasks):
    model = hs.load_verifier_model(p.verifier, "float32" if p.model_dtype == "auto" else p.model_dtype)
    dtype = getattr(torch, p.dtype)
    for task in tasks:
        rows = read_jsonl(task.inputs[0])
        samples = [hs.build_sample(model, row, p.aux_layer_ids, p.num_layers, p.max_len, dtype) for row in rows]
        hs.write_shard(str(task.entry), samples, {
            "aux_layer_ids": list(p.aux_layer_ids), "num_layers": p.num_layers,
            "hidden_size": int(model.config.hidden_size), "dtype": p.dtype, "verifier": p.verifier_id,
        })
        print(f"shard {task.shard}: {len(samples)} samples, "
              f"{sum(int(s['input_ids'].numel()) for s in samples)} tokens", flush=True)


own, shards = stage_tasks(snakemake, ["completions"])
store = Path(snakemake.output[0]).parents[1] / STORE / "hidden_states"
code = code_digest([Path(snakemake.scriptdir) / "hidden_states.py"])
run_stage(own, shards, store, ".safetensors", stage_settings(snakemake), code, compute,
          share=snakemake.config["resources"]["hidden_states"]["share_engine"], check=hs.check_shard_header)
