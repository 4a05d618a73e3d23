"""The ``draft`` section as the workflow reads it: what shapes the draft (the draft rule's param ``draft``:
:func:`shaping_draft_settings`) and what a draft method cannot take (:func:`check_method`)."""

from __future__ import annotations

from draftpipe.workflow.errors import ConfigError

#: ``draft`` keys that shape no draft (untracked: :class:`draftpipe.workflow.settings.DraftJob`)
DRAFT_UNTRACKED = ("min_train_samples", "loggers")
#: ``draft`` keys left out at these values: a draft built before the key existed is not retrained
DRAFT_DEFAULTS_LEFT_OUT = {"init": "random", "select": "last", "method": "eagle3"}
#: ``draft`` keys only one method reads: left out of the other method's params, so changing them reruns no draft
#: they do not shape
METHOD_KEYS = {
    "eagle3": ("ttt_steps", "ttt_step_loss_decay", "norm_before_residual", "norm_before_fc", "norm_output"),
    "dflash": ("dflash",),
}


def shaping_draft_settings(draft: dict) -> dict:
    """The ``draft`` section as the draft rule's param ``draft``: what shapes the draft only. Left out: the quality
    gate and the loggers (:data:`DRAFT_UNTRACKED`), the keys at the values of :data:`DRAFT_DEFAULTS_LEFT_OUT`, and
    the other method's keys (:data:`METHOD_KEYS`)."""
    method = draft.get("method", "eagle3")
    other = {k for m, keys in METHOD_KEYS.items() if m != method for k in keys}
    return {
        k: v
        for k, v in draft.items()
        if k not in DRAFT_UNTRACKED and k not in other and DRAFT_DEFAULTS_LEFT_OUT.get(k, object()) != v
    }


def check_method(config: dict, vocab_size: int) -> None:
    """The knobs a DFlash draft (``draft.method: dflash``) cannot take: ``draft.init: verifier`` (it copies a
    Llama decoder layer, EAGLE-3's; DFlash's layer is speculators' Qwen3 DFlash layer), ``draft.sliding_window``
    (vLLM serves a DFlash draft's layers with one causality, and speculators trains full-attention layers
    bidirectional within a block, sliding ones causal: mixing them serves something else than was trained),
    ``hidden_states.storage: stream`` (its producer feeds EAGLE-3 training only, for now), a
    ``bench.num_speculative_tokens`` above the ``block_size - 1`` tokens a block proposes and a
    ``draft.dflash.mask_token_id`` outside the verifier's vocabulary.

    Raises:
        ConfigError: naming the key and why.
    """
    draft = config.get("draft") or {}
    if draft.get("method", "eagle3") != "dflash":
        return
    why = "with draft.method: dflash"
    if draft.get("init", "random") != "random":
        raise ConfigError(
            f"draft.init: {draft['init']} starts an EAGLE-3 draft from the verifier's layer; a DFlash draft "
            f"starts random: remove draft.init {why}"
        )
    if draft.get("sliding_window"):
        raise ConfigError(
            f"draft.sliding_window: {draft['sliding_window']}: a DFlash draft's layers attend to their whole block "
            f"and context (full attention, as vLLM serves them); set it to null {why}"
        )
    if ((config.get("hidden_states") or {}).get("storage") or "disk") == "stream":
        raise ConfigError(f"hidden_states.storage: stream feeds EAGLE-3 training only for now: use disk {why}")
    block = (draft.get("dflash") or {}).get("block_size", 8)
    ks = [k for k in ((config.get("bench") or {}).get("num_speculative_tokens") or []) if k > block - 1]
    if ks:
        raise ConfigError(
            f"bench.num_speculative_tokens: {ks} exceed the {block - 1} token(s) a DFlash block of "
            f"draft.dflash.block_size: {block} proposes; benchmark k <= {block - 1} {why}"
        )
    mask = (draft.get("dflash") or {}).get("mask_token_id")
    if mask is not None and mask >= vocab_size:
        raise ConfigError(
            f"draft.dflash.mask_token_id: {mask} is not a token of the verifier's vocabulary of {vocab_size}"
        )
