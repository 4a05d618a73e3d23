"""Rule `hidden_states`: aux + last hidden states and loss mask of every sample of one shard."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821

from draftpipe.runtime import start_job

start_job(snakemake)  # ML environment, log, this job's GPUs and threads

import torch  # noqa: E402 (after CUDA_VISIBLE_DEVICES is set)

from draftpipe.hidden_states import build_sample, load_verifier_model, write_shard  # noqa: E402
from draftpipe.io import read_jsonl  # noqa: E402

p = snakemake.params
model_dtype = "float32" if p.model_dtype == "auto" else p.model_dtype
model = load_verifier_model(p.verifier, model_dtype)
rows = read_jsonl(snakemake.input.completions)
dtype = getattr(torch, p.dtype)
samples = [build_sample(model, row, p.aux_layer_ids, p.num_layers, p.max_len, dtype) for row in rows]
write_shard(snakemake.output[0], samples, {
    "aux_layer_ids": list(p.aux_layer_ids), "num_layers": p.num_layers,
    "hidden_size": int(model.config.hidden_size), "dtype": p.dtype, "verifier": p.verifier_id,
})
print(f"{len(samples)} samples, {sum(int(s['input_ids'].numel()) for s in samples)} tokens")
