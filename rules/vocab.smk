# Stage 4: vocab maps. Frequencies of loss-masked completion tokens -> d2t (int64 offsets) and t2d (bool mask).
rule vocab_maps:
    input:
        completions=completion_shards,
        verifier=verifier_files,
    output:
        maps="results/vocab/vocab_maps.safetensors",
        freq="results/vocab/token_freq.csv",
    params:
        verifier=VERIFIER_DIR,
        verifier_id=VERIFIER_ID,
        draft_vocab_size=DERIVED["draft_vocab_size"],
        vocab_size=DERIVED["vocab_size"],
        max_len=config["verifier"]["max_model_len"],
    log:
        "results/logs/vocab_maps.log",
    benchmark:
        "results/benchmarks/vocab_maps.tsv"
    threads: res("vocab_maps", "threads")
    resources:
        **stage_resources("vocab_maps"),
    conda:
        ML_ENV
    script:
        "../scripts/vocab_maps.py"
