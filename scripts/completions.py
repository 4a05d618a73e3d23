"""Rule `completions`: the verifier regenerates the answers of one training shard with vLLM."""

if __name__ == "__main__":  # vLLM's CPU engine spawns workers that re-run this file as __mp_main__
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

    from draftpipe.runtime import engine_parallelism, start_job

    start_job(snakemake)  # ML environment, log, this job's GPUs and threads

    from draftpipe.completions import generate_completions
    from draftpipe.io import read_jsonl, write_jsonl

    p = snakemake.params
    s = p.sampling
    rows, stats = generate_completions(
        read_jsonl(snakemake.input.prompts), p.verifier,
        samples_per_prompt=s["samples_per_prompt"], temperature=s["temperature"], top_p=s["top_p"],
        max_tokens=s["max_tokens"], seed=s["seed"], max_model_len=p.max_model_len, dtype=p.dtype,
        too_long=s["too_long"], chat_template=p.chat_template,
        engine=engine_parallelism(snakemake.resources.gpu),
    )
    write_jsonl(snakemake.output[0], rows)
    print(stats)
