"""Rule `completions`: the verifier regenerates the answers of a training shard with vLLM.

The first job of the stage loads the verifier once and fills every stale shard (draftpipe/runtime/store.py); the others
link their result from the stage's store.
"""

if __name__ == "__main__":  # vLLM's CPU engine spawns workers that re-run this file as __mp_main__
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

    from draftpipe.core.progress import console
    from draftpipe.runtime.job import engine_parallelism, job

    with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
        import draftpipe.stages.completions.generate as completions
        from draftpipe.core.gates import check_truncated
        from draftpipe.core.io import check_jsonl, read_jsonl, write_jsonl
        from draftpipe.core.layout import store_dir
        from draftpipe.formats.chat import planned_template
        from draftpipe.inference.engine import open_engine
        from draftpipe.runtime.store import code_digest, run_stage, stage_settings, stage_tasks
        from draftpipe.stages.completions.settings import CompletionSettings
        from draftpipe.workflow.settings import CompletionsJob, read_job_settings

        p = snakemake.params
        job_s = read_job_settings(CompletionsJob, p.untracked)
        template_file = planned_template(job_s.chat_template_file, p.chat_template_sha256)
        settings = CompletionSettings.from_params(p.sampling, p.max_model_len, p.chat_template, template_file)

        def compute(tasks):
            records = [read_jsonl(t.inputs[0]) for t in tasks]
            # the tokenizer gate: a tokenizer that does not give the prompts back stops the stage before its engine
            n = sum(completions.tokenizer_gate(p.verifier, recs, template_file) for recs in records)
            print(f"tokenizer gate: {n} prompt texts come back from the verifier's tokenizer unchanged", flush=True)
            llm = open_engine(
                p.verifier,
                dtype=p.dtype,
                max_model_len=p.max_model_len,
                seed=settings.seed,
                engine=engine_parallelism(snakemake.resources.gpu),
                # a shard's requests go in together: each may hold up to max_model_len tokens
                concurrent_tokens=max(map(len, records)) * settings.samples_per_prompt * p.max_model_len,
                job_mem_mb=snakemake.resources.get("mem_mb"),
            )
            for task, recs in zip(tasks, records):
                rows, stats = completions.complete(
                    llm,
                    recs,
                    verifier=p.verifier,
                    settings=settings,
                    progress=f"completions shard {task.shard}",
                )
                write_jsonl(task.entry, rows)
                print(f"shard {task.shard}: {stats}", flush=True)
                console(f"completions shard {task.shard}: {completions.summary(rows, stats)}")

        own, shards = stage_tasks(snakemake, ["prompts"])
        store = store_dir(snakemake.output[0], "completions")
        run_stage(
            own,
            shards,
            store,
            ".jsonl",
            stage_settings(snakemake),
            code_digest([Path(snakemake.scriptdir) / "completions.py"]),
            compute,
            share=job_s.share_engine,
            check=check_jsonl,
        )
        # the quality gate runs on the stored shard: failing it loses nothing (see draftpipe/core/gates.py)
        check_truncated(read_jsonl(own.output), job_s.max_truncated_fraction, own.output)
