"""The draft stage's settings: every knob of the ``draft`` section, typed (:class:`DraftSettings`, with DFlash's own
in :class:`DFlashSettings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the draft methods: vLLM's ``speculative_config.method`` and speculators' ``speculators_model_type``
METHODS = ("eagle3", "dflash")


@dataclass
class DFlashSettings:
    """``draft.dflash``: DFlash's own knobs (speculators' ``DFlashDraftModel``; defaults are the schema's)."""

    #: slots of a draft block: the anchor and ``block_size - 1`` proposed tokens
    block_size: int = 8
    #: the token id of the slots still to predict (None: ``speculators.train.utils.resolve_mask_token_id``)
    mask_token_id: int | None = None
    #: anchor blocks drawn per packed batch
    max_anchors: int = 512


@dataclass
class DraftSettings:
    """Every knob of the ``draft`` section: the ones that shape the checkpoint reach the rule through ``params:``;
    the quality gate ``min_train_samples`` and the metric ``loggers`` do not (they are read from the config, and
    changing them retrains nothing).

    The defaults are the schema's (``draft`` in ``draftpipe/workflow/config.schema.yaml``, which fills them into the
    workflow's config); ``tests/unit/test_settings.py`` holds the two together."""

    num_layers: int = 1
    head_dim: int | None = None
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    epochs: int = 10
    lr: float = 1e-4
    total_seq_len: int = 8192
    seed: int = 0
    val_every: int = 10
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    norm_output: bool = True
    loss_fn: str = "kl_div"
    scheduler_type: str = "linear"
    sliding_window: int | None = None
    #: ``random`` (speculators' start) or ``verifier`` (:mod:`draftpipe.stages.draft.warm_start`)
    init: str = "random"
    #: packed batches of ``total_seq_len`` tokens per optimizer step (the global batch; the ranks share them, so
    #: their number must divide it): see :mod:`draftpipe.stages.draft.ranks`
    batches_per_step: int = 1
    #: ``eagle3`` or ``dflash`` (:data:`METHODS`)
    method: str = "eagle3"
    dflash: DFlashSettings = field(default_factory=DFlashSettings)
    #: the epoch exported: ``last`` or ``best_val`` (lowest validation loss):
    #: :func:`draftpipe.stages.draft.checkpoint.selected_checkpoint`
    select: str = "last"
    #: quality gate (:func:`draftpipe.core.gates.check_train_samples`), not a param
    min_train_samples: int = 1
    #: speculators' metric loggers (:mod:`draftpipe.stages.draft.loggers`), not a param: they watch, shape nothing
    loggers: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.loggers = tuple(self.loggers)  # the config's list
        if isinstance(self.dflash, dict):  # the config's mapping (params, a rank's launch spec)
            self.dflash = DFlashSettings(**self.dflash)


def settings_from_params(params: dict[str, Any]) -> DraftSettings:
    """``DraftSettings`` from the rule's ``params.draft`` mapping (unknown keys go to ``extra``)."""
    known = {f for f in DraftSettings.__dataclass_fields__ if f != "extra"}
    return DraftSettings(
        **{k: v for k, v in params.items() if k in known}, extra={k: v for k, v in params.items() if k not in known}
    )
