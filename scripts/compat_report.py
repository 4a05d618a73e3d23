"""Rule `compat_report`: static checks of the draft against vLLM's EAGLE-3 loader, plus a live vLLM check.
Exits non-zero on any error finding, so nothing downstream runs on a broken draft."""

if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(snakemake.scriptdir).parent))  # noqa: F821 (injected by Snakemake)

    from draftpipe.runtime.job import job

    with job(snakemake):  # ML environment, log, GPUs, threads; manifests when the block ends normally
        from draftpipe.checks.compat.checker import check
        from draftpipe.checks.compat.live import (
            add_live_findings,
            live_check,
            live_unsupported,
            skip_live_without_prompts,
        )
        from draftpipe.checks.compat.report import render_markdown, verdict_line
        from draftpipe.core.io import read_jsonl, write_json, write_text
        from draftpipe.core.progress import console
        from draftpipe.inference.engine import speculative_dtype

        p = snakemake.params
        draft_dir = str(Path(snakemake.input.model).parent)
        rep = check(draft_dir, p.verifier, expect=dict(p.expect))
        unsupported = live_unsupported(p.verifier, speculative_dtype(p.dtype)) if p.live and rep.ok else None
        if unsupported:
            rep.add(
                "live.unsupported",
                "warning",
                "vLLM",
                "the live check cannot run with this vLLM build",
                expected="an engine with the draft",
                found=unsupported,
                fix="run the live check (or bench_run) on a GPU",
            )
            rep.live = {"skipped": unsupported}
        elif p.live and rep.ok:
            from draftpipe.formats.chat import planned_template, verifier_tokenizer
            from draftpipe.inference.prompting import encode_and_fit
            from draftpipe.workflow.settings import ReportJob, read_job_settings

            job_s = read_job_settings(ReportJob, p.untracked)
            tok = verifier_tokenizer(
                p.verifier, planned_template(job_s.chat_template_file, p.rendering["chat_template_sha256"])
            )
            records = read_jsonl(snakemake.input.prompts)[: p.live_prompts]
            # completions.too_long, as for the completions: a prompt without room for the check's tokens
            fitted, counts = encode_and_fit(
                tok,
                records,
                template_kwargs=p.rendering["template_kwargs"],
                max_model_len=p.max_model_len,
                room=p.live_max_tokens,
                too_long=p.too_long,
                stage="the live check",
            )
            print(f"live check: {counts}")
            ids = [i for _, i in fitted]
            if not ids:
                skip_live_without_prompts(rep, len(records), job_s.eval_fraction)
            else:
                add_live_findings(
                    rep,
                    live_check(
                        draft_dir,
                        p.verifier,
                        ids,
                        max_tokens=p.live_max_tokens,
                        max_model_len=p.max_model_len,
                        dtype=speculative_dtype(p.dtype),
                    ),
                )
        elif not p.live:
            rep.live = {"skipped": "live check disabled (report.live_check) or vLLM not installed"}
        md = render_markdown(rep)
        print(md)
        console(f"compat_report: {verdict_line(rep)}")
        if not rep.ok:
            sys.exit(f"compat_report: {len(rep.errors)} error(s); see the report above")
        write_json(snakemake.output.json, rep.to_dict())
        write_text(snakemake.output.md, md)
