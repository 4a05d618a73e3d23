"""MkDocs hook: the pages generated when the site builds, from their one source each.

- ``reference/config.md``: from ``draftpipe/workflow/config.schema.yaml`` (:mod:`draftpipe.workflow.reference`);
- ``reference/cli.md``: each console script of the package (``[project.scripts]``) asked for its ``--help``, the text
  its own argument parser prints;
- ``changelog.md``: ``CHANGELOG.md`` at the top of the repository.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tomllib
from importlib import import_module
from pathlib import Path

from mkdocs.structure.files import File

from draftpipe.workflow.reference import render_config_reference

ROOT = Path(__file__).resolve().parents[2]


def command_help(name: str, target: str) -> str:
    """What ``<name> --help`` prints: the entry point ``module:function`` called with ``["--help"]`` in this process
    (argparse prints the help and exits 0), 100 columns wide."""
    module, _, function = target.partition(":")
    main = getattr(import_module(module), function)
    out = io.StringIO()
    argv0, columns = sys.argv[0], os.environ.get("COLUMNS")
    sys.argv[0], os.environ["COLUMNS"] = name, "100"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["--help"])
    finally:
        sys.argv[0] = argv0
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue()


def render_cli_reference() -> str:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    lines = [
        "# Command-line reference",
        "",
        "The package's commands (installed into `.venv/bin/` by `envs/setup.sh`), each as its own `--help` prints it",
        "when this site is built. Each is also `python -m` of its module.",
    ]
    for name, target in scripts.items():
        lines += [
            "",
            f"## `{name}`",
            "",
            f"`{target.partition(':')[0]}`",
            "",
            "```text",
            command_help(name, target).rstrip(),
            "```",
        ]
    return "\n".join(lines) + "\n"


def on_files(files, config):
    pages = {
        "reference/config.md": render_config_reference(),
        "reference/cli.md": render_cli_reference(),
        "changelog.md": (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"),
    }
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    return files
