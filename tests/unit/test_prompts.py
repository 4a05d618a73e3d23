"""Prompt-set stage: formats, normalisation, ids, dedup, split/shard stability, and errors naming file and line."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest
from conftest import REPO, TINYSTORIES

from draftpipe.formats.prompts import (
    PromptFormatError,
    is_eval,
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
    assert normalise_record({"turns": ["first", "second"]}, "f:1") == [{"role": "user", "content": "first"}]
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
