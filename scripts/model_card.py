"""Rule `model_card`: the draft's README.md with the Hub's metadata, its training data, compatibility verdict and
benchmark."""

if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

    from draftpipe.runtime.job import job

    with job(snakemake):  # ML environment, log, threads; manifests when the block ends normally
        from draftpipe.core.io import write_text
        from draftpipe.core.progress import console
        from draftpipe.publish.card import load_json, read_metrics, render_card

        p = snakemake.params
        inp = snakemake.input
        text = render_card(
            draft_config=load_json(inp.config),
            metrics=read_metrics(inp.metrics),
            prompt_stats=load_json(inp.prompts),
            completion_stats=load_json(inp.completions),
            compat=load_json(inp.compat),
            bench=load_json(inp.get("bench")),
            verifier=p.verifier,
            base_model=p.base_model,
            license=p.license,
            datasets=list(p.datasets),
            tags=list(p.tags),
            title=p.title,
            sampling=dict(p.sampling),
        )
        write_text(snakemake.output.card, text)
        console(f"model card: {snakemake.output.card} (base_model {p.base_model or 'none: set verifier.hub_id'})")
