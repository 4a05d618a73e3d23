"""The draft methods as the workflow reads them: which ``draft`` keys shape which method's draft (the draft rule's
param), and the knobs a DFlash draft cannot take, refused when the workflow is read."""

from __future__ import annotations

import pytest

from draftpipe.workflow.draft import check_method, shaping_draft_settings
from draftpipe.workflow.errors import ConfigError

DRAFT = {"num_layers": 1, "ttt_steps": 3, "norm_output": True, "epochs": 4, "loggers": [], "min_train_samples": 1,
         "init": "random", "select": "last", "method": "eagle3", "dflash": {"block_size": 8}}  # fmt: skip


def test_each_method_s_params_hold_only_what_shapes_its_draft():
    # EAGLE-3 (the default): no method, no DFlash knobs, so a draft built before them keeps its params
    assert shaping_draft_settings(DRAFT) == {"num_layers": 1, "ttt_steps": 3, "norm_output": True, "epochs": 4}
    # DFlash: its block, not EAGLE-3's TTT steps or norms
    dflash = shaping_draft_settings({**DRAFT, "method": "dflash", "ttt_steps": 5})
    assert dflash == {"num_layers": 1, "epochs": 4, "method": "dflash", "dflash": {"block_size": 8}}
    assert shaping_draft_settings({**DRAFT, "select": "best_val"})["select"] == "best_val"


def _config(**draft):
    return {"draft": {"method": "dflash", **draft}, "hidden_states": {"storage": "disk"},
            "bench": {"num_speculative_tokens": [1, 3]}}  # fmt: skip


@pytest.mark.parametrize(
    "config,message",
    [
        (_config(init="verifier"), r"draft\.init: verifier starts an EAGLE-3 draft .* remove draft\.init with draft\.method: dflash"),
        (_config(sliding_window=64), r"draft\.sliding_window: 64: a DFlash draft's layers attend .*set it to null"),
        ({**_config(), "hidden_states": {"storage": "stream"}}, r"hidden_states\.storage: stream feeds EAGLE-3 training only"),
        (_config(dflash={"block_size": 3}), r"bench\.num_speculative_tokens: \[3\] exceed the 2 token\(s\) a DFlash block of draft\.dflash\.block_size: 3"),
        (_config(dflash={"mask_token_id": 512}), r"draft\.dflash\.mask_token_id: 512 is not a token of the verifier's vocabulary of 512"),
    ],
    ids=["init", "sliding_window", "stream", "bench_k", "mask_token"],
)  # fmt: skip
def test_what_a_dflash_draft_cannot_take_is_refused_naming_the_key(config, message):
    with pytest.raises(ConfigError, match=message):
        check_method(config, 512)
    check_method({**config, "draft": {**config["draft"], "method": "eagle3"}}, 512)  # an EAGLE-3 draft takes it
    check_method(_config(dflash={"block_size": 4, "mask_token_id": 2}), 512)
