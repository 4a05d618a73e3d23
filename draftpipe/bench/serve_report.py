"""The served benchmark in the report: the sweep's table, the served against the offline acceptance length, where
the draft stops paying, and a plot (speedup against concurrency; the throughput-interactivity curve).

Per-user speed is ``1000 / median TPOT`` (output tokens/s one user sees after the first token); total speed is the
output tokens/s of the run. The curve of a server is its points over the concurrencies, one line with the draft and
one without: a point above and to the right is better on both axes.
"""

from __future__ import annotations

from draftpipe.bench.benchmark import pyplot, save_png
from draftpipe.bench.serve import break_even


def serve_warnings(gaps: list[dict], tolerance: float) -> list[str]:
    """One line per served acceptance length that differs from the offline one by more than ``tolerance``
    (rows of :func:`draftpipe.bench.serve.offline_gaps`)."""
    return [
        f"served acceptance length {g['served']:.3f} on {g['prompt_set']} at concurrency {g['concurrency']} differs "
        f"from the offline {g['offline']:.3f} (k={g['num_speculative_tokens']}, temperature 0, same prompts) by "
        f"{g['gap']:+.3f}, more than bench.serve.acceptance_tolerance={tolerance:g}"
        for g in gaps
        if not g["within"]
    ]


def render_serve_section(serve: dict, gaps: list[dict], *, tolerance: float, plot: str | None, digits: int = 3) -> str:
    """Markdown: the sweep's table (per prompt set and concurrency: output tokens/s with / without the draft, their
    ratio, TPOT and ITL medians and p99, TTFT median, acceptance length from the server's counters, texts identical
    with and without the draft), the offline comparison with its warnings, and the concurrency where the draft
    stops paying."""
    f = lambda v: "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))  # noqa: E731
    st = serve["settings"]
    lines = [
        "## Served: `vllm serve`, concurrency sweep",
        "",
        f"vLLM's API server for the verifier alone and with the draft (k={st['num_speculative_tokens']}), vLLM's "
        f"serving benchmark at each concurrency (requests in flight at most, sent as one ends), temperature 0, at most "
        f"{st['max_tokens']} tokens per request; acceptance from the server's `vllm:spec_decode` counters.",
        "",
        "| prompt set | concurrency | prompts | tokens/s (draft / alone) | speedup | TPOT ms median (draft / alone) | "
        "TPOT ms p99 (draft / alone) | ITL ms median (draft / alone) | ITL ms p99 (draft / alone) | "
        "TTFT ms median (draft / alone) | acceptance length | identical texts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in serve["results"]:
        d, b = r["draft"], r["baseline"]

        def pair(key, d=d, b=b):
            return f"{f(d[key])} / {f(b[key])}"

        lines.append(
            f"| {r['prompt_set']} | {r['concurrency']} | {r['num_prompts']} | {pair('output_tokens_per_s')} | "
            f"{f(r['speedup'])} | {pair('tpot_median_ms')} | {pair('tpot_p99_ms')} | {pair('itl_median_ms')} | "
            f"{pair('itl_p99_ms')} | {pair('ttft_median_ms')} | {f(d['acceptance_length'])} | "
            f"{r['identical_texts']}/{r['num_prompts']} |"
        )
    for name in dict.fromkeys(r["prompt_set"] for r in serve["results"]):
        c = break_even(serve, name)
        lines += [
            "",
            f"{name}: the draft pays at every concurrency measured"
            if c is None
            else f"{name}: the draft stops paying at concurrency {c} (speedup below 1)",
        ]
    if gaps:
        lines += [
            "",
            f"Served against offline acceptance length (same prompts, temperature 0; tolerance {tolerance:g}):",
            "",
            "| prompt set | concurrency | k | served | offline | gap |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {g['prompt_set']} | {g['concurrency']} | {g['num_speculative_tokens']} | {f(g['served'])} | "
            f"{f(g['offline'])} | {f(g['gap'])}{'' if g['within'] else ' (WARNING)'} |"
            for g in gaps
        ]
    else:
        lines += ["", "No offline measurement at the served k and temperature 0 to compare with."]
    lines += [f"\nWARNING: {w}" for w in serve_warnings(gaps, tolerance)]
    if plot:
        lines += ["", f"![served sweep]({plot})"]
    return "\n".join(lines) + "\n"


def plot_serve(serve: dict, out_png: str, *, dpi: int = 120, title: str = "") -> None:
    """A PNG of two panels: speedup (output tokens/s with / without the draft) against concurrency per prompt set,
    and output tokens/s against per-user tokens/s (``1000 / median TPOT``) with and without the draft, each point
    labelled with its concurrency."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    sets = list(dict.fromkeys(r["prompt_set"] for r in serve["results"]))
    for name in sets:
        rows = sorted((r for r in serve["results"] if r["prompt_set"] == name), key=lambda r: r["concurrency"])
        ax1.plot([r["concurrency"] for r in rows], [r["speedup"] or 0 for r in rows], marker="o", label=name)
        for key, style, who in (("draft", "-o", "with draft"), ("baseline", "--s", "alone")):
            pts = [(r, r[key]) for r in rows if r[key]["tpot_median_ms"]]
            xs = [1000.0 / m["tpot_median_ms"] for _, m in pts]
            ys = [m["output_tokens_per_s"] for _, m in pts]
            ax2.plot(xs, ys, style, label=f"{name} {who}")
            for (r, _), x, y in zip(pts, xs, ys):
                ax2.annotate(str(r["concurrency"]), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax1.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(sorted({r["concurrency"] for r in serve["results"]}))
    ax1.xaxis.set_major_formatter(ScalarFormatter())
    ax1.xaxis.set_minor_formatter(NullFormatter())
    ax1.set_xlabel("concurrency (requests in flight)")
    ax1.set_ylabel("speedup (output tokens/s vs verifier alone)")
    ax2.set_xlabel("per-user tokens/s (1000 / median TPOT)")
    ax2.set_ylabel("output tokens/s (all users)")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: served, concurrency sweep".lstrip(": "), fontsize=10)
    save_png(plt, fig, out_png, dpi)
