"""Rule `model_card`: the draft's README.md with the Hub's metadata, its training data, compatibility verdict and
benchmark."""

if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

    from draftpipe.runtime.job import job

    with job(snakemake):  # ML environment, log, threads; manifests when the block ends normally
        from draftpipe.core.io import load_json, write_text
        from draftpipe.core.progress import console
        from draftpipe.publish.card import read_metrics, render_card

        def read(path):
            return None if path is None else load_json(Path(path).read_bytes())

        p = snakemake.params
        inp = snakemake.input
        text = render_card(
            draft_config=read(inp.config),
            metrics=read_metrics(inp.metrics),
            prompt_stats=read(inp.prompts),
            completion_stats=read(inp.completions),
            compat=read(inp.compat),
            bench=read(inp.get("bench")),
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
