"""``python -m draftpipe.checks.compat``: :func:`draftpipe.checks.compat.cli.main`."""

from draftpipe.checks.compat.cli import main

raise SystemExit(main())
