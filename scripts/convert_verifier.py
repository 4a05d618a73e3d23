"""Rule `verifier`: GGUF -> Hugging Face directory (tokenizer and chat template as the GGUF holds them, weights
dequantized to verifier.dtype, the head_dim re-parameterisation vLLM's kernels need)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (snakemake is injected)

from draftpipe.runtime.job import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    from draftpipe.core.io import remove_interrupted_writes
    from draftpipe.stages.verifier import convert_gguf

    out_dir = Path(snakemake.output.config).parent
    for left in remove_interrupted_writes([out_dir]):  # a build directory of a killed conversion
        print(f"removed {left} (left by an interrupted conversion)", flush=True)

    summary = convert_gguf(
        snakemake.input.gguf,
        str(out_dir),
        head_dim=snakemake.params.head_dim,
        max_position_embeddings=snakemake.params.max_position_embeddings,
        dtype=snakemake.params.dtype,
    )
    print(summary)
