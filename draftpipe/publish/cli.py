"""``draftpipe-publish DRAFT_DIR --repo ORG/NAME [--private] [--dry-run]``: push a built draft folder to the
Hugging Face Hub with ``huggingface_hub`` (``create_repo``, ``upload_folder``), after checking it is fit to publish:
weights, config and model card present, the card's metadata readable, and no file naming a folder of the machine
that built it."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from draftpipe.core.io import sha256_file
from draftpipe.formats.hub_sources import REPO_ID

#: what is published of a draft folder (the manifests, logs and training state stay with the build)
PUBLISHED = ("config.json", "model.safetensors", "README.md", "metrics.csv")
#: files a draft cannot be published without
REQUIRED = ("config.json", "model.safetensors", "README.md")
#: bytes of a file scanned for local paths (the weights' JSON header sits in its first bytes)
SCAN_BYTES = 1 << 20


class PublishError(ValueError):
    """The folder is not fit to publish; the message names the file and what to do."""


def published_files(draft_dir: str | Path) -> list[Path]:
    """The files of ``draft_dir`` that are published (:data:`PUBLISHED`, after ``huggingface_hub``'s own filter, the
    one ``upload_folder`` applies), sorted."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(draft_dir)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    return [folder / n for n in filter_repo_objects(names, allow_patterns=list(PUBLISHED))]


def local_paths(text: str, roots: list[str]) -> list[str]:
    """The places in ``text`` that name one of ``roots`` (absolute folders of this machine), each with a little of
    its context."""
    found = []
    for root in roots:
        for m in re.finditer(re.escape(root.rstrip("/")) + r"(?=/|\"|'|\s|$)", text):
            found.append(text[max(0, m.start() - 20) : m.end() + 40].replace("\n", " "))
    return found


def check_publishable(draft_dir: str | Path, roots: list[str] | None = None) -> list[Path]:
    """The files to publish, checked.

    Args:
        draft_dir: the draft folder (``results/draft``).
        roots: absolute folders no file may name (default: the draft folder's workflow, the home directory and the
            current directory).

    Raises:
        PublishError: a required file is missing, the card has no readable metadata, or a file names a local path.
    """
    from huggingface_hub import ModelCard

    folder = Path(draft_dir).resolve()
    if not folder.is_dir():
        raise PublishError(f"{draft_dir}: not a folder (build it: snakemake results/draft/README.md --cores all)")
    missing = [n for n in REQUIRED if not (folder / n).is_file()]
    if missing:
        raise PublishError(
            f"{draft_dir}: {', '.join(missing)} missing; build the draft and its card first: "
            f"snakemake {' '.join('results/draft/' + n for n in missing)} --cores all"
        )
    try:
        card = ModelCard.load(folder / "README.md")
    except Exception as exc:  # the card's YAML metadata, as the Hub reads it
        raise PublishError(
            f"{draft_dir}/README.md: its metadata cannot be read ({type(exc).__name__}: {exc})"
        ) from None
    if not card.data.to_dict():
        raise PublishError(f"{draft_dir}/README.md: no metadata block (--- YAML ---) at its top")
    if roots is None:
        roots = sorted({str(folder.parent.parent), str(Path.home()), os.getcwd()} - {"/"})
    files = published_files(folder)
    for path in files:
        with open(path, "rb") as f:
            head = f.read(SCAN_BYTES).decode("utf-8", errors="replace")
        hits = local_paths(head, roots)
        if hits:
            raise PublishError(
                f"{path.name}: names a folder of this machine ({hits[0]!r}); rebuild it with a hub id "
                "(verifier.hub_id) or remove the path"
            )
    return files


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 0 published (or would), 1 not fit to publish, 2 a Hub error."""
    ap = argparse.ArgumentParser(prog="draftpipe-publish", description=__doc__.split("\n\n")[0])
    ap.add_argument("draft_dir", help="the draft folder, e.g. results/draft")
    ap.add_argument("--repo", required=True, help="the Hub model repository, ORG/NAME (created when absent)")
    ap.add_argument("--private", action="store_true", help="create the repository private")
    ap.add_argument("--revision", default=None, help="the branch to push to (default: main)")
    ap.add_argument("--dry-run", action="store_true", help="list what would be sent; send nothing")
    args = ap.parse_args(argv)
    if not REPO_ID.match(args.repo):
        print(f"draftpipe-publish: --repo {args.repo!r} is not a Hub repository id (ORG/NAME)", file=sys.stderr)
        return 1
    try:
        files = check_publishable(args.draft_dir)
    except PublishError as exc:
        print(f"draftpipe-publish: {exc}", file=sys.stderr)
        return 1
    total = sum(p.stat().st_size for p in files)
    where = f"https://huggingface.co/{args.repo}" + (f" (branch {args.revision})" if args.revision else "")
    verb = "would upload" if args.dry_run else "uploading"
    print(
        f"draftpipe-publish: {verb} {len(files)} files, {total:,} bytes, to {where}"
        f"{' (private)' if args.private else ''}"
    )
    for p in files:
        print(f"  {p.name}\t{p.stat().st_size:,} bytes\tsha256 {sha256_file(p)}")
    if args.dry_run:
        return 0
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(args.repo, private=args.private, exist_ok=True)
        info = api.upload_folder(
            repo_id=args.repo,
            folder_path=args.draft_dir,
            allow_patterns=[p.name for p in files],
            revision=args.revision,
            commit_message="EAGLE-3 draft built by draftpipe",
        )
    except (HfHubHTTPError, OSError, ValueError) as exc:
        print(f"draftpipe-publish: the Hub refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"draftpipe-publish: published {info.commit_url if hasattr(info, 'commit_url') else info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
