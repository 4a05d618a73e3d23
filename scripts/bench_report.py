"""Rule `bench_report`: plots and a markdown report from the benchmark summary (presentation only)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

from draftpipe.runtime.job import job

with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
    from draftpipe.bench.benchmark import plot, plot_training, render_report
    from draftpipe.bench.serve import offline_gaps
    from draftpipe.bench.serve_report import plot_serve, render_serve_section, serve_warnings
    from draftpipe.core.gates import check_acceptance
    from draftpipe.core.io import write_text
    from draftpipe.workflow.settings import BenchReportJob, read_job_settings

    style = snakemake.params.style
    summary = json.loads(Path(snakemake.input.summary).read_text())
    # the quality gate reads the measurement, which stays when it fails (the threshold is untracked: changing it reruns nothing)
    gate = read_job_settings(BenchReportJob, snakemake.params.untracked)
    check_acceptance(summary, gate.min_acceptance_length, snakemake.input.summary)
    out = snakemake.output
    plot(summary, out.per_position, out.vs_k, dpi=style["dpi"], title=style["title"])
    plot_training(snakemake.input.metrics, out.training, dpi=style["dpi"], title=style["title"])
    plots = {
        "per-position acceptance": Path(out.per_position).name,
        "acceptance length and speedup vs k": Path(out.vs_k).name,
        "training curves": Path(out.training).name,
    }
    text = render_report(summary, title=style["title"], plots=plots, digits=style["digits"])
    if "serve" in snakemake.input.keys():  # bench.serve set: the served sweep beside the offline benchmark
        serve = json.loads(Path(snakemake.input.serve).read_text())
        tolerance = snakemake.params.serve_tolerance
        gaps = offline_gaps(serve, summary, tolerance)
        for line in serve_warnings(gaps, tolerance):
            print(f"WARNING: {line}")
        plot_serve(serve, out.serve, dpi=style["dpi"], title=style["title"])
        text += "\n" + render_serve_section(
            serve, gaps, tolerance=tolerance, plot=Path(out.serve).name, digits=style["digits"]
        )
    write_text(out.report, text)
