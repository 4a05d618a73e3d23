# Stage 5: the EAGLE-3 draft, trained with speculators, saved in the speculators format vLLM loads; with
# hidden_states.storage: stream it extracts the hidden states from vLLM as it trains (no shard is written).
rule draft:
    input:
        unpack(draft_data),  # hidden-state shards, or the completions when they are streamed
        vocab=rules.vocab_maps.output.maps,
        verifier=verifier_files,
    output:
        model="results/draft/model.safetensors",
        config="results/draft/config.json",
        metrics=report("results/draft/metrics.csv", category="Training"),
    params:
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        verifier_name=published_verifier(VERIFIER, config),  # config.json's verifier: its hub id, never a path
        draft=draft_params(),  # what shapes the draft (rules/common.smk)
        **stream_params(),  # hidden_states.storage: stream only
        untracked=job_settings("draft", config),  # shapes nothing: draftpipe/workflow/settings.py
    log:
        "results/logs/draft.log",
    benchmark:
        "results/benchmarks/draft.tsv"
    threads: res("draft", "threads")
    resources:
        **stage_resources("draft"),
    conda:
        ML_ENV
    script:
        "../scripts/train_draft.py"
