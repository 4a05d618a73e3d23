"""The error the workflow's config checks raise (re-exported by :mod:`draftpipe.workflow.config`)."""


class ConfigError(ValueError):
    """A config value is wrong; the message names the key (``section.key``)."""
