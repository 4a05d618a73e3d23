"""Prompt-set stage: formats, normalisation, ids, dedup, split/shard stability, and errors naming file and line."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest
from conftest import REPO, TINYSTORIES

from draftpipe.formats.prompts import (
    PromptFormatError,
    answered_prefix,
    is_eval,
    is_unanswered,
    load_prompts,
    normalise_record,
    prompt_id,
    shard_of,
    split_and_shard,
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_tinystories_default_set():
    records, stats = load_prompts([{"path": str(TINYSTORIES)}])
    assert stats.read == 44 and stats.kept == 44 and stats.empty == 0 and stats.duplicates == 0
    assert records[0]["messages"][0]["role"] == "user"
    assert [r["id"] for r in records] == sorted(r["id"] for r in records)
    assert all(len(r["id"]) == 16 for r in records)


def test_record_shapes_normalise_to_chat():
    assert normalise_record({"prompt": "hi"}, "f:1") == [{"role": "user", "content": "hi"}]
    assert normalise_record({"turns": ["first", "second"]}, "f:1") == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": None},  # unanswered: the verifier writes it
        {"role": "user", "content": "second"},
    ]
    conv = {
        "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ]
    }
    assert normalise_record(conv, "f:1") == [{"role": "system", "content": "be nice"}, {"role": "user", "content": "q"}]
    msgs = {
        "messages": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"},
        ]
    }
    assert [m["content"] for m in normalise_record(msgs, "f:1")] == ["q1", "a1", "q2"]
    assert normalise_record({"question": "2+2?"}, "f:1", text_field="question") == [{"role": "user", "content": "2+2?"}]


def test_malformed_line_names_file_and_line(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "ok"}\n{"prompt": "broken"\n', encoding="utf-8")
    with pytest.raises(PromptFormatError, match=r"p\.jsonl:2: malformed JSON line"):
        load_prompts([{"path": str(src)}])


def test_unknown_shape_and_non_utf8(tmp_path):
    src = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a"}, {"text": "b"}])
    with pytest.raises(PromptFormatError, match=r"q\.jsonl:2: record has none of the keys"):
        load_prompts([{"path": str(src)}])
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(PromptFormatError, match=r"b\.jsonl:2: not valid UTF-8"):
        load_prompts([{"path": str(bad)}])


def test_empty_and_duplicate_prompts_are_dropped_and_counted(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}, {"prompt": "   "}, {"prompt": "y"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    records, stats = load_prompts([{"path": str(a)}, {"path": str(b)}])
    assert (stats.read, stats.empty, stats.duplicates, stats.kept) == (4, 1, 1, 2)
    assert {r["messages"][0]["content"] for r in records} == {"x", "y"}


def test_json_parquet_and_gzip_sources(tmp_path):
    rows = [{"prompt": f"story {i}"} for i in range(5)]
    (tmp_path / "a.json").write_text(json.dumps(rows), encoding="utf-8")
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    ids = None
    for name in ("a.json", "a.parquet", "a.jsonl.gz"):
        records, _ = load_prompts([{"path": str(tmp_path / name)}])
        got = [r["id"] for r in records]
        assert len(got) == 5
        ids = ids or got
        assert got == ids


def test_id_is_content_hash():
    m = [{"role": "user", "content": "Once upon a time"}]
    assert prompt_id(m) == prompt_id([dict(m[0])])
    assert prompt_id(m) != prompt_id([{"role": "user", "content": "Once upon a time."}])


def test_split_and_shards_are_stable_when_prompts_are_appended(tmp_path):
    base = [{"prompt": f"prompt number {i}"} for i in range(200)]
    more = base + [{"prompt": f"appended {i}"} for i in range(50)]
    r1, _ = load_prompts([{"path": str(write_jsonl(tmp_path / "1.jsonl", base))}])
    r2, _ = load_prompts([{"path": str(write_jsonl(tmp_path / "2.jsonl", more))}])
    s1, e1 = split_and_shard(r1, 0.2, 4, seed=0)
    s2, e2 = split_and_shard(r2, 0.2, 4, seed=0)
    ids1 = [{r["id"] for r in s} for s in s1]
    ids2 = [{r["id"] for r in s} for s in s2]
    assert all(a <= b for a, b in zip(ids1, ids2))
    assert {r["id"] for r in e1} <= {r["id"] for r in e2}
    assert 20 <= len(e1) <= 60  # about 20 % of 200
    assert sum(len(s) for s in s1) + len(e1) == 200
    assert all(shard_of(r["id"], 4) == k for k, s in enumerate(s1) for r in s)
    assert all(is_eval(r["id"], 0.2, 0) for r in e1)


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError):
        split_and_shard([], 0.1, 0, 0)
    with pytest.raises(ValueError):
        split_and_shard([], 1.0, 1, 0)


CHAT = REPO / "tests" / "data" / "chat" / "conversations.jsonl"


def test_conversations_keep_every_turn_tool_calls_and_tools():
    records, stats = load_prompts([{"path": str(CHAT)}])
    assert stats.kept == 3 and stats.empty == 0
    tools = next(r for r in records if "tools" in r)
    msgs = tools["messages"]
    assert [m["role"] for m in msgs] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert msgs[4] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"place": "park"}'}}
        ],
    }
    assert msgs[5] == {"role": "tool", "content": "sunny and warm", "tool_call_id": "call_0", "name": "get_weather"}
    assert tools["tools"][0]["function"]["name"] == "get_weather"
    assert tools["id"] == prompt_id(msgs, tools["tools"]) != prompt_id(msgs)  # tool definitions are content
    sharegpt = next(r for r in records if len(r["messages"]) == 3)
    assert [m["content"] for m in sharegpt["messages"]][1:] == [
        "DATASET SHAREGPT ANSWER",
        "What did Lily find in the garden?",
    ]


def test_sharegpt_tool_turns_and_a_conversation_ending_in_a_tool_result():
    conv = {
        "conversations": [
            {"from": "human", "value": "weather?"},
            {"from": "function_call", "value": '{"name": "get", "arguments": {"at": "park"}}'},
            {"from": "observation", "value": "sun"},
        ]
    }
    assert normalise_record(conv, "f:1") == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"at": "park"}}}],
        },
        {"role": "tool", "content": "sun"},
    ]


def test_system_prompt_is_a_first_turn_and_part_of_the_fingerprint(tmp_path):
    from draftpipe.workflow.fingerprint import prompt_fingerprints

    src = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "q1"}, {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "q2"}]}],
    )
    plain, _ = load_prompts([{"path": str(src)}])
    with_sys, _ = load_prompts([{"path": str(src)}], "Be brief.")
    by_q = {r["messages"][-1]["content"]: r for r in with_sys}
    assert by_q["q1"]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q1"}]
    assert by_q["q2"]["messages"][0] == {"role": "system", "content": "own"}  # a record's own system turn stays
    assert {r["id"] for r in plain} ^ {r["id"] for r in with_sys} == {
        next(r["id"] for r in plain if r["messages"][-1]["content"] == "q1"),
        by_q["q1"]["id"],
    }
    fp = lambda system: prompt_fingerprints([{"path": str(src)}], 0.0, 1, 0, system)["train"]
    assert fp(None) != fp("Be brief.") and fp("Be brief.") == fp("Be brief.")


def test_unanswered_assistant_turns_mt_bench_and_null_content():
    """MT-bench's later questions follow an unanswered assistant turn; a chat source marks one with null content.
    Prompting stages send the part before the first one; a record with no question before it is dropped."""
    mt = normalise_record({"turns": ["q1", "  ", "q2", "q3"]}, "f:1")  # a blank question asks nothing
    assert [(m["role"], m["content"]) for m in mt] == [
        ("user", "q1"),
        ("assistant", None),
        ("user", "q2"),
        ("assistant", None),
        ("user", "q3"),
    ]
    assert [is_unanswered(m) for m in mt] == [False, True, False, True, False]
    assert answered_prefix(mt) == [{"role": "user", "content": "q1"}]
    chat = normalise_record(
        {
            "messages": [
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "q3"},
                {"role": "assistant", "content": None},  # trailing: removed as every trailing answer is
            ]
        },
        "f:1",
    )
    assert [m["content"] for m in chat] == ["q1", "a1", "q2", None, "q3"]
    assert answered_prefix(chat) == chat[:3]
    assert answered_prefix(chat[:3]) == chat[:3]
    # a tool call with null content is a call, not an unanswered turn
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    assert not is_unanswered(normalise_record({"messages": [{"role": "user", "content": "q"}, call]}, "f:1")[-1])
    for empty in (
        {"turns": ["  ", ""]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": None}, chat[0]]},
    ):
        assert normalise_record(empty, "f:1") == []
    with pytest.raises(PromptFormatError, match="f:1: 'turns' must be a list of strings"):
        normalise_record({"turns": ["q1", 2]}, "f:1")


def test_shipped_mt_bench_keeps_both_questions():
    records, stats = load_prompts([{"path": str(REPO / "draftpipe/data/prompts/mt_bench_question.jsonl")}])
    assert stats.read == stats.kept == 80
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant", "user"] for r in records)
    assert all(len(answered_prefix(r["messages"])) == 1 for r in records)


def test_the_plan_bounds_a_conversation_by_the_answers_the_verifier_writes():
    """MT-bench's conversations hold two answers: the plan's token bound counts both, capped by max_model_len."""
    import yaml

    from draftpipe.workflow.fingerprint import prompt_fingerprints
    from draftpipe.workflow.plan import sample_tokens

    mt = {"path": str(REPO / "draftpipe/data/prompts/mt_bench_question.jsonl")}
    fp = prompt_fingerprints([mt, {"path": str(TINYSTORIES)}], 0.25, 2, 0)
    assert fp["train_answers"][2] + fp["train_answers"][1] == fp["train_prompts"]
    assert 50 <= fp["train_answers"][2] <= 70 and 25 <= fp["train_answers"][1] <= 40  # 80 and 44, less a quarter
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["completions"].update(samples_per_prompt=2, max_tokens=100)
    cfg["verifier"]["max_model_len"] = 1000
    assert sample_tokens(cfg, {1: 3, 2: 5}, 40.0) == (240, 2 * (3 * 140 + 5 * 240))
    cfg["verifier"]["max_model_len"] = 200
    assert sample_tokens(cfg, {1: 3, 2: 5}, 40.0) == (200, 2 * (3 * 140 + 5 * 200))
