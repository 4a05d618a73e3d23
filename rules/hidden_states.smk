# Stage 3: hidden-state shards from vLLM (extract_hidden_states). Aux hidden states (vLLM layer ids), last hidden
# state and loss mask per sample; tensor parallel over the job's GPUs.
rule hidden_states:
    input:
        completions="results/completions/train_{shard}.jsonl",
        verifier=verifier_files,
    output:
        "results/hidden_states/train_{shard}.safetensors",
    params:
        # the stage's shards (ids 00000..num_shards-1): the first job fills every stale one (draftpipe/runtime/store.py); a
        # count, not the id list, which would make every job's params, and the dry run, grow with the shard count
        num_shards=len(SHARDS),
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        aux_layer_ids=DERIVED["aux_layer_ids"],
        num_layers=DERIVED["num_hidden_layers"],
        hidden_size=DERIVED["hidden_size"],
        dtype=config["hidden_states"]["dtype"],
        max_len=config["verifier"]["max_model_len"],
        model_dtype=config["verifier"]["dtype"],
        untracked=job_settings("hidden_states", config),  # shapes nothing: draftpipe/workflow/settings.py
    log:
        "results/logs/hidden_states/train_{shard}.log",
    benchmark:
        "results/benchmarks/hidden_states/train_{shard}.tsv"
    priority: 10  # all shards of a stage before the next stage: one verifier load per stage
    threads: res("hidden_states", "threads")
    resources:
        **stage_resources("hidden_states"),
    conda:
        ML_ENV
    script:
        "../scripts/hidden_states.py"
