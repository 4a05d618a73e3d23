"""``python -m draftpipe.checks.verify [RESULTS_DIR] [--repair]``: check a results tree against its provenance manifests.

Prints one line per finding (``STATUS path: reason``, see :func:`draftpipe.runtime.integrity.verify_tree`) and a
summary line. Exit status 0 when nothing is corrupt or stale, else 1 (also after ``--repair``, which moves the
corrupt artifacts and their manifests to ``RESULTS_DIR/.quarantine/<timestamp>/`` and prints the ``snakemake``
command that rebuilds them, the stale artifacts and everything downstream; stale artifacts stay in place).
"""

from __future__ import annotations

import argparse
import sys

from draftpipe.core.layout import STORE
from draftpipe.formats.provenance import quarantine
from draftpipe.runtime.integrity import CORRUPT, NOTE, STALE, verify_tree


def main(argv: list[str] | None = None) -> int:
    """Run the command with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    ap = argparse.ArgumentParser(prog="python -m draftpipe.checks.verify", description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", nargs="?", default="results", help="results directory (default: results)")
    ap.add_argument(
        "--repair",
        action="store_true",
        help="move corrupt artifacts and their manifests to RESULTS_DIR/.quarantine/<timestamp>/",
    )
    ap.add_argument(
        "--workdir",
        default=None,
        help="directory that manifests' relative input paths are relative to (default: the parent of RESULTS_DIR)",
    )
    ap.add_argument("--no-shards", action="store_true", help="skip reading the hidden-state shards' tensors")
    args = ap.parse_args(argv)

    findings = verify_tree(args.results_dir, workdir=args.workdir, check_shards=not args.no_shards)
    for f in findings:
        print(f.line())
    counts = {s: sum(f.status == s for f in findings) for s in (CORRUPT, STALE, NOTE)}
    print(f"verify {args.results_dir}: {counts[CORRUPT]} corrupt, {counts[STALE]} stale, {counts[NOTE]} note(s)")
    if args.repair:
        corrupt = sorted({f.path for f in findings if f.status == CORRUPT})
        stale = sorted({f.path for f in findings if f.status == STALE} - set(corrupt))
        for src, dest in quarantine(corrupt, args.results_dir):
            print(f"moved {src} -> {dest}")
        if corrupt or stale:
            # a store entry is no target: the job of its artifact computes it again
            targets = [c for c in corrupt if f"/{STORE}/" not in f"/{c}"]
            print(
                f"repair: {len(corrupt)} corrupt artifact(s) quarantined, {len(stale)} stale left in place; "
                f"rebuild with: {rebuild_command(targets, stale)}"
            )
    return 1 if counts[CORRUPT] or counts[STALE] else 0


def rebuild_command(quarantined: list[str], stale: list[str]) -> str:
    """The ``snakemake`` command that rebuilds quarantined and stale artifacts and everything built from them.

    Quarantined artifacts are named as targets beside the default ``all``: Snakemake does not rerun anything
    for a missing intermediate file whose dependents are up to date. Stale ones are forced (their files exist,
    and are newer than their inputs when an input was restored from elsewhere).
    """
    cmd = ["snakemake"]
    if quarantined:
        cmd += ["all", *quarantined]
    if stale:
        cmd += ["--forcerun", *stale]
    return " ".join(cmd)


if __name__ == "__main__":
    sys.exit(main())
