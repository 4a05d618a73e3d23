"""``draftpipe-check`` (``python -m draftpipe.checks.compat``): check any EAGLE-3 checkpoint against vLLM's loader."""

from __future__ import annotations

from draftpipe.checks.compat.checker import check
from draftpipe.checks.compat.live import add_live_findings, live_check
from draftpipe.checks.compat.report import CompatError, render_markdown
from draftpipe.core.io import write_json, write_text


def main(argv: list[str] | None = None) -> int:
    """``python -m draftpipe.checks.compat DRAFT_DIR --verifier DIR|config.json [--json F] [--md F]``; exit 1 on errors."""
    import argparse

    parser = argparse.ArgumentParser(description="Check an EAGLE-3 draft checkpoint against vLLM's loader")
    parser.add_argument("draft", help="draft directory (config.json + model.safetensors), either format")
    parser.add_argument("--verifier", required=True, help="verifier directory or its config.json")
    parser.add_argument("--json", help="write the machine-readable report here")
    parser.add_argument("--md", help="write the report for a person here")
    parser.add_argument("--expect-head-dim", type=int)
    parser.add_argument("--expect-draft-vocab-size", type=int)
    parser.add_argument("--live", action="store_true", help="also load the draft in vLLM and generate a few tokens")
    args = parser.parse_args(argv)
    expect = {"head_dim": args.expect_head_dim, "draft_vocab_size": args.expect_draft_vocab_size}
    try:
        rep = check(args.draft, args.verifier, expect=expect)
    except CompatError as exc:
        print(f"error: {exc}")
        return 2
    if args.live and rep.ok:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.verifier)
        ids = [tok("Once upon a time")["input_ids"]]
        add_live_findings(rep, live_check(args.draft, args.verifier, ids))

    if args.json:
        write_json(args.json, rep.to_dict())
    md = render_markdown(rep)
    if args.md:
        write_text(args.md, md)
    print(md)
    return 0 if rep.ok else 1
