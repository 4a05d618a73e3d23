"""The completions stage's settings, typed once (:class:`CompletionSettings`), and the seed of each request."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CompletionSettings:
    """Every setting that shapes the completions of a shard: the ``completions`` section (less the quality gate
    ``max_truncated_fraction``, which shapes nothing) and what the verifier section adds (``max_model_len``, the
    chat template policy and file). Built once by :meth:`from_params` from the rule's params.

    Attributes:
        samples_per_prompt, temperature, top_p, max_tokens, seed: sampling (``completions.*``); each request's seed
            is :func:`request_seed` of ``seed`` and the prompt id.
        max_model_len: the engine's context in tokens (``verifier.max_model_len``).
        too_long: ``completions.too_long``: ``drop``, ``truncate`` or ``error``
            (:func:`draftpipe.inference.prompting.fit_prompt`).
        chat_template: ``verifier.chat_template``: ``auto`` or ``required``.
        chat_template_file: ``verifier.chat_template_file`` as planned (None: the tokenizer's own template).
        turns: ``completions.turns``, one of :data:`draftpipe.formats.prompts.TURNS`.
        reasoning: ``completions.reasoning``: ``keep``, ``strip`` or ``off``.
    """

    samples_per_prompt: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    max_model_len: int
    too_long: str = "drop"
    chat_template: str = "auto"
    chat_template_file: str | None = None
    turns: str = "all"
    reasoning: str = "keep"

    @classmethod
    def from_params(
        cls, sampling: dict[str, Any], max_model_len: int, chat_template: str, chat_template_file: str | None
    ) -> CompletionSettings:
        """The settings of the ``completions`` rule: ``params.sampling`` (the ``completions`` section without the
        quality gate), ``params.max_model_len``, ``params.chat_template`` and the planned template file.

        Raises:
            KeyError: ``sampling`` lacks a key of the schema (the workflow fills every default).
        """
        keys = ("samples_per_prompt", "temperature", "top_p", "max_tokens", "seed", "too_long", "turns", "reasoning")
        return cls(
            **{k: sampling[k] for k in keys},
            max_model_len=max_model_len,
            chat_template=chat_template,
            chat_template_file=chat_template_file,
        )


def request_seed(base_seed: int, prompt_id: str) -> int:
    """Per-prompt sampling seed: independent of batch composition and of which shard holds the prompt."""
    return int(hashlib.sha256(f"{base_seed}:{prompt_id}".encode()).hexdigest()[:8], 16)
