"""Rule `hidden_states`: aux + last hidden states and loss mask of every sample of a training shard, from vLLM.

The first job of the stage starts one vLLM engine (``extract_hidden_states``, tensor parallel over the job's GPUs)
and fills every stale shard whose completions exist (draftpipe/runtime/store.py); the others link their result from the
stage's store.
"""

if __name__ == "__main__":  # vLLM's CPU engine spawns workers that re-run this file as __mp_main__
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

    from draftpipe.core.progress import console
    from draftpipe.runtime.job import engine_parallelism, job

    with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
        import torch

        import draftpipe.formats.hidden_states as hs
        import draftpipe.stages.extract as ex
        from draftpipe.core.gates import check_empty_masks
        from draftpipe.core.io import read_jsonl
        from draftpipe.core.layout import store_dir
        from draftpipe.formats.chat import common_template, row_templates
        from draftpipe.runtime.store import code_digest, run_stage, stage_settings, stage_tasks
        from draftpipe.workflow.settings import HiddenStatesJob, read_job_settings

        p = snakemake.params
        job_s = read_job_settings(HiddenStatesJob, p.untracked)
        store = store_dir(snakemake.output[0], "hidden_states")

        def compute(tasks):
            with ex.request_dir(store) as requests:  # under the stage lock; removed however compute ends
                llm = ex.open_extractor(
                    p.verifier,
                    layer_ids=ex.engine_layer_ids(p.aux_layer_ids, p.num_layers),
                    dtype=p.model_dtype,
                    max_len=p.max_len,
                    seed=0,
                    request_dir=requests,
                    engine=engine_parallelism(snakemake.resources.gpu),
                )
                dtype = getattr(torch, p.dtype)
                # rows of two chat templates fail before any shard is computed (one streaming pass, a hash per row)
                template = common_template(row_templates([task.inputs[0] for task in tasks]))
                for task in tasks:
                    samples = ex.build_samples(
                        llm,
                        read_jsonl(task.inputs[0]),
                        aux_ids=p.aux_layer_ids,
                        num_layers=p.num_layers,
                        max_len=p.max_len,
                        dtype=dtype,
                        request_dir=requests,
                        batch_tokens=job_s.batch_tokens,
                        progress=f"hidden_states shard {task.shard}",
                    )
                    hs.write_shard(
                        str(task.entry),
                        samples,
                        {
                            "aux_layer_ids": list(p.aux_layer_ids),
                            "num_layers": p.num_layers,
                            "hidden_size": p.hidden_size,
                            "dtype": p.dtype,
                            "verifier": p.verifier_id,
                            "chat_template_sha256": template,
                        },
                    )
                    tokens = sum(int(s["input_ids"].numel()) for s in samples)
                    trained = sum(int(s["loss_mask"].sum()) for s in samples)
                    console(
                        f"hidden_states shard {task.shard}: {len(samples)} samples, {tokens} tokens ({trained} trained on)"
                    )

        own, shards = stage_tasks(snakemake, ["completions"])
        code = code_digest([Path(snakemake.scriptdir) / "hidden_states.py"])
        run_stage(
            own,
            shards,
            store,
            ".safetensors",
            stage_settings(snakemake),
            code,
            compute,
            share=job_s.share_engine,
            check=hs.check_shard_header,
        )
        # the quality gate runs on the stored shard: failing it loses nothing (see draftpipe/core/gates.py)
        check_empty_masks(hs.loss_mask_sums(own.output), job_s.max_empty_mask_fraction, own.output)
