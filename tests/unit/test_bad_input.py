"""Bad input: every kind gets one exact error message naming the file and line or the config key, and no error
ever touches finished work.

Each case asserts the whole message (``str(exc) == expected``); where a temporary path is part of the message the
expected string is built from it. Data that is well formed but holds no prompt is dropped and counted instead of
being an error; those cases assert the counts.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, TINYSTORIES

from draftpipe.core.io import write_jsonl
from draftpipe.formats.chat import ChatTemplateError, check_chat_template, encode_prompt
from draftpipe.formats.prompts import PromptFormatError, load_prompts, normalise_record
from draftpipe.formats.verifier import VerifierNotFoundError, resolve_verifier
from draftpipe.inference.prompting import PromptTooLongError, fit_prompt, prepare_prompts
from draftpipe.workflow.config import ConfigError, check_config, validate_config

ROLES = "assistant, bot, developer, function, function_call, gpt, human, ipython, model, observation, prompter, system, tool, user"
SHAPES = "'messages', 'conversations', 'turns', 'prompt'"
TRUNCATED_GZIP = "Compressed file ended before the end-of-stream marker was reached"


def raised(exc_type, fn, *args, **kwargs) -> str:
    """The message of the ``exc_type`` that ``fn(*args, **kwargs)`` raises (anything else fails the test)."""
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    assert type(info.value) is exc_type
    return str(info.value)


def jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def half_gzip(data: bytes) -> bytes:
    """``data`` gzipped without compression (stored blocks, so the cut point is known) and cut in half."""
    packed = gzip.compress(data, compresslevel=0)
    return packed[: len(packed) // 2]


OK = {"prompt": "Once upon a time"}
# 3 lines of 62 bytes; gzipped without compression: 10 header bytes, 5 block header bytes, the 186 data bytes and
# an 8-byte trailer (209 bytes). Cut in half (104 bytes) it holds line 1 and 27 bytes of line 2.
THREE_LINES = jsonl(*({"prompt": f"story {i} " + "x" * 40} for i in range(3)))

# (filename, file bytes, source "field", expected message given the source's path)
SOURCE_ERRORS = [
    pytest.param(
        "p.jsonl",
        b'{"prompt": "ok"}\n{"prompt": "broken"\n',
        None,
        lambda p: f"{p}:2: malformed JSON line (Expecting ',' delimiter at column 20)",
        id="malformed-json-line",
    ),
    pytest.param(
        "p.jsonl",
        b'{"prompt": "ok"}\n{"prompt": "a", }\n',
        None,
        lambda p: f"{p}:2: malformed JSON line (Expecting property name enclosed in double quotes at column 17)",
        id="trailing-comma",
    ),
    pytest.param(
        "p.jsonl",
        jsonl(OK, ["Once upon a time"]),
        None,
        lambda p: f"{p}:2: expected a JSON object, got array",
        id="line-is-array",
    ),
    pytest.param(
        "p.jsonl", jsonl(OK, OK, 42), None, lambda p: f"{p}:3: expected a JSON object, got number", id="line-is-number"
    ),
    pytest.param(
        "p.jsonl",
        jsonl(OK, "Once upon a time"),
        None,
        lambda p: f"{p}:2: expected a JSON object, got string",
        id="line-is-string",
    ),
    pytest.param(
        "p.jsonl", jsonl(OK, b"null"), None, lambda p: f"{p}:2: expected a JSON object, got null", id="line-is-null"
    ),
    pytest.param(
        "p.jsonl",
        jsonl(OK, {"text": "no prompt key", "title": "t"}),
        None,
        lambda p: f"{p}:2: record has none of the keys {SHAPES} (its keys: 'text', 'title')",
        id="no-prompt-key",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({}),
        None,
        lambda p: f"{p}:1: record has none of the keys {SHAPES} (its keys: none)",
        id="empty-object",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"question": "2+2?"}, {"prompt": "3+3?"}),
        "question",
        lambda p: f"{p}:2: record has no key 'question' (its keys: 'prompt')",
        id="no-configured-field",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"prompt": None}),
        None,
        lambda p: f"{p}:1: 'prompt' must be a string, got null",
        id="prompt-null",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"prompt": ["a", "b"]}),
        None,
        lambda p: f"{p}:1: 'prompt' must be a string, got array",
        id="prompt-list",
    ),
    pytest.param(
        "p.jsonl",
        b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
        None,
        lambda p: f"{p}:2: not valid UTF-8 at byte 16 of the line (invalid continuation byte)",
        id="latin1-byte-in-jsonl",
    ),
    pytest.param(
        "p.jsonl",
        b'{"prompt": "\xff\xfe"}\n',
        None,
        lambda p: f"{p}:1: not valid UTF-8 at byte 13 of the line (invalid start byte)",
        id="non-utf8-jsonl",
    ),
    pytest.param(
        "p.json",
        b'[\n  {"prompt": "a"},\n  {"prompt": "\xff"}\n]\n',
        None,
        lambda p: f"{p}:3: not valid UTF-8 (invalid start byte)",
        id="non-utf8-json",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"id": "q1", "prompt": "a"}, {"id": "q2", "prompt": "b"}, {"id": "q1", "prompt": "c"}),
        None,
        lambda p: f"{p}:3: id 'q1' was already used for a different prompt at {p}:1",
        id="explicit-id-twice",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"messages": [{"role": "narrator", "content": "a"}]}),
        None,
        lambda p: f"{p}:1: messages[0] has unknown role 'narrator' (accepted: {ROLES})",
        id="unknown-role",
    ),
    pytest.param(
        "p.jsonl",
        jsonl(
            {
                "conversations": [
                    {"from": "human", "value": "a"},
                    {"from": "critic", "value": "b"},
                    {"from": "human", "value": "c"},
                ]
            }
        ),
        None,
        lambda p: f"{p}:1: conversations[1] has unknown role 'critic' (accepted: {ROLES})",
        id="unknown-sharegpt-from",
    ),
    pytest.param(
        "p.jsonl",
        jsonl(
            {
                "conversations": [
                    {"from": "human", "value": "a"},
                    {"from": "function_call", "value": "get(x)"},
                    {"from": "observation", "value": "1"},
                ]
            }
        ),
        None,
        lambda p: f"{p}:1: conversations[1] (function_call) is not JSON (Expecting value)",
        id="sharegpt-function-call-not-json",
    ),
    pytest.param(
        "p.jsonl",
        jsonl(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": None, "tool_calls": {"name": "x"}},
                    {"role": "tool", "content": "1"},
                ]
            }
        ),
        None,
        lambda p: f"{p}:1: messages[1].tool_calls must be a list, got object",
        id="tool-calls-not-a-list",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"tools": "[{", "messages": [{"role": "user", "content": "a"}]}),
        None,
        lambda p: f"{p}:1: 'tools' is a string but not JSON (Expecting property name enclosed in double quotes)",
        id="tools-not-json",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"messages": [{"content": "a"}]}),
        None,
        lambda p: f"{p}:1: messages[0] has no 'role' (or 'from')",
        id="missing-role",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"messages": [{"role": 1, "content": "a"}]}),
        None,
        lambda p: f"{p}:1: messages[0] has unknown role 1 (accepted: {ROLES})",
        id="role-not-string",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"messages": [{"role": "user", "content": 42}]}),
        None,
        lambda p: f"{p}:1: messages[0] content must be a string or a list of text parts, got number",
        id="content-number",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"messages": [{"role": "system", "content": "s"}, {"role": "user"}]}),
        None,
        lambda p: f"{p}:1: messages[1] content must be a string or a list of text parts, got null",
        id="content-missing",
    ),
    pytest.param(
        "p.jsonl",
        jsonl(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "x.png"}},
                        ],
                    }
                ]
            }
        ),
        None,
        lambda p: f"{p}:1: messages[0] content[1] is not a text part ('image_url'); only text prompts are supported",
        id="content-image-part",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"messages": "hello"}),
        None,
        lambda p: f"{p}:1: 'messages' must be a list of messages, got string",
        id="messages-not-list",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"messages": ["hello"]}),
        None,
        lambda p: f"{p}:1: messages[0] must be an object, got string",
        id="message-not-object",
    ),
    pytest.param(
        "p.jsonl",
        jsonl({"turns": "hello"}),
        None,
        lambda p: f"{p}:1: 'turns' must be a list of strings",
        id="turns-not-list",
    ),
    pytest.param(
        "p.csv",
        b"prompt\nOnce upon a time\n",
        None,
        lambda p: (
            f"{p}: unknown prompt source format '.csv' (use .jsonl, .json or .parquet, optionally followed by .gz)"
        ),
        id="csv-suffix",
    ),
    pytest.param(
        "p.txt.gz",
        gzip.compress(b"Once upon a time\n"),
        None,
        lambda p: (
            f"{p}: unknown prompt source format '.txt' (use .jsonl, .json or .parquet, optionally followed by .gz)"
        ),
        id="txt-gz-suffix",
    ),
    pytest.param(
        "prompts",
        jsonl(OK),
        None,
        lambda p: (
            f"{p}: unknown prompt source format 'prompts' (use .jsonl, .json or .parquet, optionally followed by .gz)"
        ),
        id="no-suffix",
    ),
    pytest.param(
        "p.json",
        json.dumps({"prompts": [OK]}).encode(),
        None,
        lambda p: f"{p}: a .json prompt source must be an array of records, got object",
        id="json-object",
    ),
    pytest.param(
        "p.json",
        b'"Once upon a time"',
        None,
        lambda p: f"{p}: a .json prompt source must be an array of records, got string",
        id="json-string",
    ),
    pytest.param(
        "p.json",
        b'[\n  {"prompt": "a"},\n  {"prompt": "b"}\n  {"prompt": "c"}\n]\n',
        None,
        lambda p: f"{p}:4: malformed JSON (Expecting ',' delimiter at column 3)",
        id="json-missing-comma",
    ),
    pytest.param(
        "p.json",
        b'[\n  {"prompt": "a"},\n]\n',
        None,
        lambda p: f"{p}:3: malformed JSON (Expecting value at column 1)",
        id="json-trailing-comma",
    ),
    pytest.param(
        "p.json",
        b'[{"prompt": "a"}]\n[{"prompt": "b"}]\n',
        None,
        lambda p: f"{p}:2: malformed JSON (Extra data at column 1)",
        id="json-two-arrays",
    ),
    pytest.param(
        "p.json", b"", None, lambda p: f"{p}:1: malformed JSON (Expecting value at column 1)", id="json-empty-file"
    ),
    pytest.param(
        "p.json",
        b'[\n  {"prompt": "a"},\n  ["b"]\n]\n',
        None,
        lambda p: f"{p}:3: expected a JSON object, got array",
        id="json-item-not-object",
    ),
    pytest.param(
        "p.jsonl.gz",
        half_gzip(THREE_LINES),
        None,
        lambda p: f"{p}:2: gzip file is truncated ({TRUNCATED_GZIP})",
        id="truncated-jsonl-gz",
    ),
    pytest.param(
        "p.json.gz",
        half_gzip(json.dumps([OK] * 20).encode()),
        None,
        lambda p: f"{p}: gzip file is truncated ({TRUNCATED_GZIP})",
        id="truncated-json-gz",
    ),
    pytest.param(
        "p.jsonl.gz",
        jsonl(OK),
        None,
        lambda p: f"{p}:1: gzip file is corrupt (Not a gzipped file (b'{{\"'))",
        id="gz-not-gzipped",
    ),
    pytest.param("p.jsonl", b"", None, lambda p: f"{p}: the prompt source has no records", id="empty-jsonl"),
    pytest.param(
        "p.jsonl", b"\n  \n\n", None, lambda p: f"{p}: the prompt source has no records", id="blank-lines-only"
    ),
    pytest.param("p.json", b"[]", None, lambda p: f"{p}: the prompt source has no records", id="empty-json-array"),
    # issue 28: JSON no reader should take as it stands
    pytest.param(
        "p.jsonl",
        jsonl(OK) + b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        None,
        lambda p: f"{p}:2: JSON nested more than 64 levels deep",
        id="nested-past-the-recursion-limit",
    ),
    pytest.param(
        "p.jsonl",
        jsonl(OK) + b'{"prompt": ' + b"[" * 70 + b"]" * 70 + b"}\n",
        None,
        lambda p: f"{p}:2: JSON nested more than 64 levels deep",
        id="nested-past-the-depth-limit",
    ),
    pytest.param(
        "p.json",
        b"[" + b"[" * 100_000 + b"]" * 100_000 + b"]",
        None,
        lambda p: f"{p}:1: JSON nested more than 64 levels deep",
        id="json-array-nested-too-deep",
    ),
    pytest.param(
        "p.jsonl",
        jsonl(OK) + b'{"prompt": "first", "prompt": "second"}\n',
        None,
        lambda p: f"{p}:2: key 'prompt' appears twice in one object",
        id="duplicate-key",
    ),
    pytest.param(
        "p.json",
        b'[{"prompt": "a"},\n {"prompt": "b", "id": 1, "id": 2}]',
        None,
        lambda p: f"{p}:2: key 'id' appears twice in one object",
        id="duplicate-key-json",
    ),
    pytest.param(
        "p.jsonl",
        '{"prompt": "Once upon a time"}\n'.encode("utf-16-le"),
        None,
        lambda p: f"{p}:1: NUL characters in the line: UTF-16 or UTF-32 text? prompt sources are UTF-8",
        id="utf-16-without-bom",
    ),
    pytest.param(
        "p.jsonl",
        b'{"prompt": "a"}\r{"prompt": "b"}\r',
        None,
        lambda p: (
            f"{p}:1: lines end in a carriage return alone (CR, old Mac line ends); JSON Lines need LF or CRLF line ends"
        ),
        id="cr-only-line-ends",
    ),
    pytest.param(
        "p.jsonl",
        jsonl(OK) + b'{"prompt": "a \\ud800 b"}\n',
        None,
        lambda p: f"{p}:2: a lone surrogate (\\ud800) in a string: not text a tokenizer can take",
        id="lone-surrogate",
    ),
]


@pytest.mark.parametrize("name,content,text_field,expected", SOURCE_ERRORS)
def test_bad_source_gets_exact_message(tmp_path, name, content, text_field, expected):
    path = tmp_path / name
    path.write_bytes(content)
    src = {"path": str(path), **({"field": text_field} if text_field else {})}
    assert raised(PromptFormatError, load_prompts, [src]) == expected(path)


def test_missing_source_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    assert raised(FileNotFoundError, load_prompts, [{"path": str(path)}]) == f"prompt source {path} does not exist"


def test_error_in_second_source_names_that_source(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl(OK))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(jsonl(OK, OK, [1]))
    msg = raised(PromptFormatError, load_prompts, [{"path": str(good)}, {"path": str(bad)}])
    assert msg == f"{bad}:3: expected a JSON object, got array"


def test_unreadable_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    path.write_bytes(jsonl(OK))
    msg = raised(PromptFormatError, load_prompts, [{"path": str(path)}])
    # pyarrow's own reason follows; its wording belongs to pyarrow
    assert msg.startswith(f"{path}: not a readable parquet file (ArrowInvalid: ") and msg.endswith(")")


def test_parquet_errors_name_the_row(tmp_path):
    pd = pytest.importorskip("pandas")
    path = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": ["a", None, "c"]}).to_parquet(path)
    assert raised(PromptFormatError, load_prompts, [{"path": str(path)}]) == (
        f"{path}: row 2: 'prompt' must be a string, got null"
    )


# ------------------------------------------------------------------------------------- dropped and counted

# (records of a source whose line 2 holds no prompt)
NO_PROMPT = [
    pytest.param({"prompt": ""}, id="empty-string"),
    pytest.param({"prompt": " \t\n "}, id="whitespace-only"),
    pytest.param({"messages": []}, id="empty-messages"),
    pytest.param({"conversations": []}, id="empty-conversations"),
    pytest.param({"turns": []}, id="empty-turns"),
    pytest.param({"turns": ["  "]}, id="blank-first-turn"),
    pytest.param(
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}]},
        id="empty-user-before-answer",
    ),
    pytest.param({"messages": [{"role": "assistant", "content": "a"}]}, id="answer-only"),
    pytest.param({"messages": [{"role": "system", "content": "be brief"}]}, id="system-only"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "text", "text": "  "}]}]}, id="blank-text-parts"),
]


@pytest.mark.parametrize("record", NO_PROMPT)
def test_record_without_prompt_is_dropped_and_counted(tmp_path, record):
    path = tmp_path / "p.jsonl"
    path.write_bytes(jsonl(OK, record, {"prompt": "The end"}))
    records, stats = load_prompts([{"path": str(path)}])
    assert [r["messages"][0]["content"] for r in sorted(records, key=lambda r: r["line"])] == [
        "Once upon a time",
        "The end",
    ]
    assert (stats.read, stats.empty, stats.duplicates, stats.kept) == (3, 1, 0, 2)
    assert stats.empty_at == [f"{path}:2"]
    assert stats.per_source == {str(path): {"read": 3, "empty": 1, "kept": 2}}


def test_empty_locations_are_capped_and_counted(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(jsonl(*([{"prompt": ""}] * 12), OK))
    _, stats = load_prompts([{"path": str(path)}])
    assert stats.empty == 12 and stats.kept == 1
    assert stats.empty_at == [f"{path}:{i}" for i in range(1, 11)]


def test_source_of_only_empty_prompts_loads_with_nothing_kept(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(jsonl({"prompt": ""}, {"prompt": " "}))
    records, stats = load_prompts([{"path": str(path)}])
    assert records == [] and (stats.read, stats.empty, stats.kept) == (2, 2, 0)


def test_duplicates_by_content_and_by_explicit_id(tmp_path):
    a = tmp_path / "a.jsonl"
    # line 3 repeats line 1 (same id, same prompt): a duplicate; line 4 is the same prompt under another id
    a.write_bytes(
        jsonl({"id": 1, "prompt": "x"}, {"id": 2, "prompt": "y"}, {"id": 1, "prompt": "x"}, {"id": 3, "prompt": "x"})
    )
    b = tmp_path / "b.jsonl"
    b.write_bytes(jsonl({"id": 1, "prompt": "z"}))  # ids are per source: another source may reuse 1
    records, stats = load_prompts([{"path": str(a)}, {"path": str(b)}])
    assert sorted(r["messages"][0]["content"] for r in records) == ["x", "y", "z"]
    assert (stats.read, stats.duplicates, stats.kept) == (5, 2, 3)
    assert {r["messages"][0]["content"]: r["line"] for r in records}["x"] == 1
    # the same id for a different prompt, with a numeric id
    c = tmp_path / "c.jsonl"
    c.write_bytes(jsonl({"id": 7, "prompt": "x"}, {"id": 7, "prompt": "y"}))
    assert raised(PromptFormatError, load_prompts, [{"path": str(c)}]) == (
        f"{c}:2: id 7 was already used for a different prompt at {c}:1"
    )


def test_lenient_reading(tmp_path):
    """What is accepted although unusual: a byte-order mark, CRLF line ends, blank lines, text parts."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n{"messages": [{"role": "User", "content": '
        b'[{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]}\r\n'
    )
    records, stats = load_prompts([{"path": str(path)}])
    assert sorted((r["line"], r["messages"][0]["content"]) for r in records) == [(1, "a"), (3, "bc")]
    arr = tmp_path / "p.json"
    arr.write_bytes(b'\xef\xbb\xbf[\n  {"prompt": "a"},\n\n  {"prompt": "b"}\n]\n')
    records, _ = load_prompts([{"path": str(arr)}])
    assert sorted((r["line"], r["messages"][0]["content"]) for r in records) == [(2, "a"), (4, "b")]


def test_normalise_record_names_where():
    assert raised(PromptFormatError, normalise_record, 3.5, "src.jsonl:9") == (
        "src.jsonl:9: expected a JSON object, got number"
    )


# --------------------------------------------------------------------------------- finished work is safe


def test_failing_load_leaves_finished_output_untouched(tmp_path):
    out = tmp_path / "results" / "train_00000.jsonl"
    n = write_jsonl(out, [{"id": "a", "messages": []}, {"id": "b", "messages": []}])
    before = out.read_bytes()
    assert n == 2 and before.count(b"\n") == 2
    stat = out.stat()
    src = tmp_path / "p.jsonl"
    src.write_bytes(jsonl(OK, {"prompt": "two"}, b'{"prompt": '))

    def records():  # the writer consumes a lazy reader that fails on the third line
        from draftpipe.formats.prompt_sources import iter_source_rows

        for lineno, obj in iter_source_rows(src):
            yield {"id": str(lineno), "messages": normalise_record(obj, f"{src}:{lineno}")}

    msg = raised(PromptFormatError, write_jsonl, out, records())
    assert msg == f"{src}:3: malformed JSON line (Expecting value at column 12)"
    assert out.read_bytes() == before
    assert out.stat().st_mtime_ns == stat.st_mtime_ns and out.stat().st_ino == stat.st_ino
    assert sorted(os.listdir(out.parent)) == ["train_00000.jsonl"]  # no temporary file left behind


# --------------------------------------------------------------------------------------------- config


@pytest.fixture
def fake_verifier(tmp_path) -> dict:
    """A resolved local verifier with 5 layers and 512 tokens (only its config.json is read)."""
    d = tmp_path / "verifier"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 5, "vocab_size": 512, "hidden_size": 64}))
    return {"kind": "local", "path": str(d)}


def base_config() -> dict:
    return {
        "verifier": {"chat_template_file": None},
        "prompts": {"sources": [{"path": str(TINYSTORIES)}]},
        "hidden_states": {"aux_layer_ids": [1, 2, 4]},
        "vocab": {"draft_vocab_size": 256},
        "bench": {"prompt_sets": []},
    }


def _set(cfg: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    node = cfg
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return cfg


CONFIG_ERRORS = [
    pytest.param(
        "prompts.sources",
        [{"path": "no/such/prompts.jsonl"}],
        "prompts.sources[0].path: no/such/prompts.jsonl does not exist",
        id="missing-prompt-file",
    ),
    pytest.param(
        "prompts.sources",
        [{"path": str(TINYSTORIES.parent)}],
        f"prompts.sources[0].path: {TINYSTORIES.parent} is a directory, not a file: list each of its files as a source",
        id="prompt-source-is-a-directory",
    ),
    pytest.param(
        "prompts.sources",
        [{"path": str(TINYSTORIES)}, {"path": str(TINYSTORIES), "field": "prompt"}, {"path": str(TINYSTORIES)}],
        f"prompts.sources[2]: {TINYSTORIES} is listed twice (also prompts.sources[0]), with the same field or template; list each "
        "source once",
        id="prompt-source-twice",
    ),
    pytest.param(
        "prompts.sources",
        [{"path": str(TINYSTORIES)}, {"path": "data/missing.json"}],
        "prompts.sources[1].path: data/missing.json does not exist",
        id="missing-second-prompt-file",
    ),
    pytest.param(
        "bench.prompt_sets",
        [{"name": "mt", "path": "no/mt_bench.jsonl"}],
        "bench.prompt_sets[0].path: no/mt_bench.jsonl does not exist",
        id="missing-bench-set",
    ),
    pytest.param(
        "hidden_states.aux_layer_ids",
        [1, 2, 9],
        "hidden_states.aux_layer_ids: ids [9] are outside [0, 5] for a verifier with 5 layers",
        id="aux-id-out-of-range",
    ),
    pytest.param(
        "hidden_states.aux_layer_ids",
        [1, 1, 2],
        "hidden_states.aux_layer_ids: ids [1, 1, 2] repeat; vLLM deduplicates them, so the draft's fc would "
        "be too wide",
        id="aux-id-repeated",
    ),
    pytest.param(
        "hidden_states.aux_layer_ids",
        None,
        "hidden_states.aux_layer_ids: the default aux layer ids [2, N//2, N-3] = [2, 2, 2] are not valid for "
        "a verifier with 5 layers; set hidden_states.aux_layer_ids explicitly (for example [1, 2, 4] for 5 "
        "layers)",
        id="aux-default-too-shallow",
    ),
    pytest.param(
        "verifier.chat_template_file",
        "no/chat.jinja",
        "verifier.chat_template_file: no/chat.jinja does not exist (a Jinja chat template file, or one of tiny_chat)",
        id="missing-chat-template",
    ),
    pytest.param(
        "vocab.draft_vocab_size",
        600,
        "vocab.draft_vocab_size: 600 exceeds the verifier's vocabulary of 512",
        id="draft-vocab-too-large",
    ),
]


@pytest.mark.parametrize("key,value,expected", CONFIG_ERRORS)
def test_config_value_errors(fake_verifier, key, value, expected):
    cfg = _set(base_config(), key, value)
    assert raised(ConfigError, check_config, cfg, fake_verifier) == expected


@pytest.mark.parametrize(
    "draft,job,expected",
    [
        (
            {"batches_per_step": 3},
            {"gpus": 2},
            "draft.batches_per_step: 3 is not a multiple of the draft's 2 training ranks (resources.draft.nodes x "
            "resources.draft.ranks, or one per GPU of resources.draft.gpus): each step's packed batches are shared by the "
            "ranks",
        ),
        (
            {"batches_per_step": 8},
            {"gpus": 4, "nodes": 3},
            "draft.batches_per_step: 8 is not a multiple of the draft's 12 training ranks (resources.draft.nodes x "
            "resources.draft.ranks, or one per GPU of resources.draft.gpus): each step's packed batches are shared by the "
            "ranks",
        ),
        (
            {"batches_per_step": 4},
            {"gpus": 2, "ranks": 4},
            "resources.draft.ranks: 4 ranks on a node, but the job holds resources.draft.gpus: 2 GPU(s) there: one rank "
            "per GPU (leave ranks unset)",
        ),
    ],
    ids=["per-step", "nodes", "ranks-over-gpus"],
)
def test_draft_rank_errors(fake_verifier, draft, job, expected):
    cfg = {**base_config(), "draft": draft, "resources": {"draft": job}}
    assert raised(ConfigError, check_config, cfg, fake_verifier) == expected
    ok = {**base_config(), "draft": {"batches_per_step": 8}, "resources": {"draft": {"gpus": 4, "nodes": 2}}}
    assert check_config(ok, fake_verifier)["aux_layer_ids"] == [1, 2, 4]


LLAMA = {"num_hidden_layers": 5, "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 8}
VERIFIER_LIMITS = [  # the verifier's config.json fields, the key, its value, the message
    pytest.param(
        {"max_position_embeddings": 512},
        "verifier.max_model_len",
        4096,
        "verifier.max_model_len: 4096 exceeds the 512 tokens the verifier serves (max_position_embeddings in its "
        "config.json); vLLM refuses a longer one: set verifier.max_model_len to at most 512",
        id="context",
    ),
    pytest.param(
        {"max_position_embeddings": 4096, "seq_length": 2048, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        "verifier.max_model_len",
        16384,
        "verifier.max_model_len: 16384 exceeds the 8192 tokens the verifier serves (seq_length in its config.json); "
        "vLLM refuses a longer one: set verifier.max_model_len to at most 8192",
        id="context-smallest-key-times-rope-factor",
    ),
    pytest.param(
        {"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        "verifier.max_model_len",
        8192,
        "verifier.max_model_len: 8192 exceeds the 4096 tokens the verifier serves (max_position_embeddings in its "
        "config.json); vLLM refuses a longer one: set verifier.max_model_len to at most 4096",
        id="context-yarn-already-scaled",
    ),
    pytest.param(
        {},
        "draft.head_dim",
        7,
        "draft.head_dim: 7 is odd; rotary position embeddings rotate pairs of dimensions, so the draft's head_dim "
        "must be even (null = the verifier's)",
        id="odd-head-dim",
    ),
    pytest.param(
        {"num_key_value_heads": 4},
        "resources.hidden_states.gpus",
        3,
        "resources.hidden_states.gpus: 3 GPUs (vLLM's tensor parallel size) do not divide the verifier's 8 "
        "attention heads (num_attention_heads in its config.json); use one of 1, 2, 4, 8",
        id="tp-heads",
    ),
    pytest.param(
        {"num_attention_heads": 12, "num_key_value_heads": 4},
        "resources.completions.gpus",
        6,
        "resources.completions.gpus: 6 GPUs (vLLM's tensor parallel size) and the verifier's 4 KV heads "
        "(num_key_value_heads in its config.json): one must divide the other",
        id="tp-kv-heads",
    ),
]


def _verifier_dir(tmp_path, fields: dict) -> dict:
    d = tmp_path / "limits"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return {"kind": "local", "path": str(d)}


@pytest.mark.parametrize("fields,key,value,expected", VERIFIER_LIMITS)
def test_values_the_verifier_refuses_fail_when_the_workflow_is_read(tmp_path, fields, key, value, expected):
    verifier = _verifier_dir(tmp_path, fields)
    cfg = _set_path(base_config(), "verifier.max_model_len", 512)
    assert check_config(copy.deepcopy(cfg), verifier)["num_hidden_layers"] == 5  # passes without the value
    assert raised(ConfigError, check_config, _set_path(cfg, key, value), verifier) == expected


def _set_path(cfg: dict, dotted: str, value) -> dict:
    node = cfg
    *parents, last = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return cfg


def test_values_within_the_verifier_s_limits_pass(tmp_path):
    verifier = _verifier_dir(
        tmp_path,
        {"max_position_embeddings": 512, "model_max_length": 1024, "num_key_value_heads": 4, "kv_lora_rank": None},
    )
    cfg = _set_path(base_config(), "verifier.max_model_len", 1024)  # model_max_length allows it, as in vLLM
    _set_path(cfg, "draft.head_dim", 16)
    for stage, gpus in (("completions", 8), ("hidden_states", 4), ("bench_run", 2)):
        _set_path(cfg, f"resources.{stage}.gpus", gpus)
    assert check_config(cfg, verifier)["aux_layer_ids"] == [1, 2, 4]
    # an MLA verifier (DeepSeek-V3) has no KV heads to split: only its attention heads count
    mla = _verifier_dir(tmp_path / "mla", {"num_attention_heads": 12, "num_key_value_heads": 4, "kv_lora_rank": 32})
    assert check_config(_set_path(base_config(), "resources.hidden_states.gpus", 6), mla)["num_hidden_layers"] == 5


def test_the_embedded_gguf_s_context_is_its_conversion_setting():
    from conftest import GGUF

    cfg = _set_path(base_config(), "verifier.max_model_len", 1024)
    cfg["verifier"]["gguf_max_position_embeddings"] = 512
    assert raised(ConfigError, check_config, cfg, {"kind": "gguf", "path": str(GGUF)}) == (
        "verifier.max_model_len: 1024 exceeds the 512 tokens the verifier serves "
        "(verifier.gguf_max_position_embeddings); vLLM refuses a longer one: set verifier.max_model_len to at most 512"
    )
    cfg["verifier"]["max_model_len"] = 512
    assert check_config(cfg, {"kind": "gguf", "path": str(GGUF)})["num_hidden_layers"] == 5


def test_good_config_passes_check(fake_verifier):
    assert check_config(base_config(), fake_verifier) == {
        "aux_layer_ids": [1, 2, 4],
        "draft_vocab_size": 256,
        "num_hidden_layers": 5,
        "vocab_size": 512,
        "hidden_size": 64,
    }


@pytest.fixture(scope="module")
def shipped_config() -> dict:
    return yaml.safe_load((REPO / "config.yaml").read_text(encoding="utf-8"))


def test_shipped_config_is_valid(shipped_config):
    validate_config(shipped_config)  # raises ConfigError otherwise
    assert shipped_config["completions"]["too_long"] == "drop"
    assert shipped_config["verifier"]["chat_template"] == "auto"


SCHEMA_ERRORS = [
    pytest.param(
        "completions.too_long",
        "chop",
        "completions.too_long: 'chop' is not one of ['drop', 'truncate', 'error']",
        id="too-long-enum",
    ),
    pytest.param(
        "verifier.chat_template",
        "yes",
        "verifier.chat_template: 'yes' is not one of ['auto', 'required']",
        id="chat-template-enum",
    ),
    pytest.param(
        "completions.temprature",
        0.5,
        "completions.temprature: unknown key (known keys: max_tokens, max_truncated_fraction, reasoning, "
        "samples_per_prompt, seed, temperature, too_long, top_p, turns)",
        id="misspelt-key",
    ),
    pytest.param(
        "completions.reasoning",
        "think",
        "completions.reasoning: 'think' is not one of ['keep', 'strip', 'off']",
        id="reasoning-enum",
    ),
    pytest.param(
        "completions.turns", "first", "completions.turns: 'first' is not one of ['all', 'last']", id="turns-enum"
    ),
    pytest.param("draft.epochs", "three", "draft.epochs: 'three' is not of type 'integer'", id="wrong-type"),
    pytest.param(
        "completions.top_p", 1.5, "completions.top_p: 1.5 is greater than the maximum of 1", id="above-maximum"
    ),
    pytest.param(
        "hidden_states.aux_layer_ids",
        [1, -2, 4],
        "hidden_states.aux_layer_ids[1]: -2 is less than the minimum of 0",
        id="negative-aux-id",
    ),
    pytest.param(
        "prompts.sources", [{"path": ""}], "prompts.sources[0].path: '' should be non-empty", id="empty-source-path"
    ),
    pytest.param(
        "prompts.sources",
        [{"file": "p.jsonl"}],
        "prompts.sources[0].file: unknown key (known keys: dataset, field, ignore, max_records, name, path, revision, "
        "split, template)",
        id="source-key-misspelt",
    ),
    # issue 28: what speculators refuses minutes into the draft job, refused when the workflow is read
    pytest.param(
        "draft.loss_fn",
        "bogus",
        "draft.loss_fn: 'bogus' is neither a loss of speculators (ce, jsd, kl_div, lk_hybrid, nla, rkl, tv) nor a "
        """JSON object of them to weights (e.g. '{"ce": 0.1, "tv": 0.9}')""",
        id="loss-fn-unknown",
    ),
    pytest.param(
        "draft.loss_fn",
        '{"ce": 0.5, "kl": 0.5}',
        "draft.loss_fn: 'kl' is not a loss of speculators (ce, jsd, kl_div, lk_hybrid, nla, rkl, tv)",
        id="loss-fn-weights-unknown-name",
    ),
    pytest.param(
        "draft.loss_fn",
        '{"ce": "0.5"}',
        "draft.loss_fn: the weight of 'ce' must be a number, not '0.5'",
        id="loss-fn-weight-not-a-number",
    ),
]


@pytest.mark.parametrize("key,value,expected", SCHEMA_ERRORS)
def test_config_schema_errors_name_the_key(shipped_config, key, value, expected):
    cfg = _set(copy.deepcopy(shipped_config), key, value)
    assert raised(ConfigError, validate_config, cfg) == expected


def test_config_schema_missing_section(shipped_config):
    cfg = copy.deepcopy(shipped_config)
    del cfg["verifier"]["path"]
    assert raised(ConfigError, validate_config, cfg) == "verifier.path: missing (a required key)"
    del cfg["vocab"]
    assert raised(ConfigError, validate_config, cfg) == "vocab: missing (a required key)"


# ------------------------------------------------------------------------------------------- verifier


def test_verifier_lookup_errors(tmp_path, monkeypatch):
    missing_dir = tmp_path / "models" / "llama"
    assert raised(VerifierNotFoundError, resolve_verifier, str(missing_dir)) == (
        f"verifier.path: '{missing_dir}' does not exist (resolved to '{missing_dir}') and is not a Hugging Face "
        "model id of the form 'namespace/name'"
    )
    missing_gguf = tmp_path / "stories.gguf"
    assert raised(VerifierNotFoundError, resolve_verifier, str(missing_gguf)) == (
        f"verifier.path: GGUF file '{missing_gguf}' does not exist (resolved to '{missing_gguf}')"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert raised(VerifierNotFoundError, resolve_verifier, str(empty)) == (
        f"verifier.path: directory '{empty}' has no config.json, so it is not a Hugging Face model directory"
    )
    (empty / "model.Q8_0.gguf").write_bytes(b"GGUF")
    assert raised(VerifierNotFoundError, resolve_verifier, str(empty)) == (
        f"verifier.path: directory '{empty}' has no config.json, so it is not a Hugging Face model directory "
        f"(it contains model.Q8_0.gguf: point verifier.path at the .gguf file)"
    )
    notes = tmp_path / "model.safetensors"
    notes.write_bytes(b"x")
    assert raised(VerifierNotFoundError, resolve_verifier, str(notes)) == (
        f"verifier.path: '{notes}' is a file but not a .gguf file; give a .gguf file or a Hugging Face model "
        "directory containing config.json"
    )
    assert raised(VerifierNotFoundError, resolve_verifier, "  ") == (
        "verifier.path: expected a path or a Hugging Face model id, got '  '"
    )
    # hub-shaped but clearly local: the parent directory exists (no hub lookup)
    monkeypatch.chdir(tmp_path)
    assert raised(VerifierNotFoundError, resolve_verifier, "empty/llama") == (
        f"verifier.path: 'empty/llama' does not exist, although its parent directory 'empty' does (resolved to "
        f"'{os.getcwd()}/empty/llama'); not looking it up on the Hugging Face hub"
    )


# ----------------------------------------------------------------------------------------- completions


FIT = [  # ids length, max_model_len, policy, expected length or None
    pytest.param(9, 10, "drop", 9, id="fits-drop"),
    pytest.param(9, 10, "error", 9, id="fits-error"),
    pytest.param(9, 10, "truncate", 9, id="fits-truncate"),
    pytest.param(10, 10, "drop", None, id="no-room-drop"),
    pytest.param(25, 10, "drop", None, id="longer-drop"),
    pytest.param(10, 10, "truncate", 9, id="no-room-truncate"),
    pytest.param(25, 10, "truncate", 9, id="longer-truncate"),
]


@pytest.mark.parametrize("n,max_len,policy,expected", FIT)
def test_fit_prompt(n, max_len, policy, expected):
    ids = list(range(100, 100 + n))
    got = fit_prompt(ids, max_len, policy, "p")
    assert got == (None if expected is None else ids[:expected])


def test_fit_prompt_truncate_keeps_the_first_tokens_and_reserve():
    ids = list(range(1, 31))
    assert fit_prompt(ids, 20, "truncate", "p", reserve=8) == list(range(1, 13))
    assert fit_prompt(ids[:15], 20, "truncate", "p", reserve=8) == ids[:15]  # fits: untouched


def test_fit_prompt_errors():
    assert raised(PromptTooLongError, fit_prompt, list(range(12)), 10, "error", "0123456789abcdef") == (
        "completions.too_long: prompt 0123456789abcdef has 12 tokens, which leaves no room for a new token in "
        "verifier.max_model_len=10 (set completions.too_long to drop or truncate to go on)"
    )
    assert raised(ValueError, fit_prompt, [1], 10, "chop", "p") == (
        "completions.too_long: unknown policy 'chop' (use drop, truncate or error)"
    )
    assert raised(ValueError, fit_prompt, [1], 10, "truncate", "p", reserve=10) == (
        "reserve must be in [1, 9] for max_model_len 10, got 10"
    )


def test_completions_module_does_not_import_vllm():
    code = (
        "import sys, draftpipe.stages.completions.generate, draftpipe.stages.completions.conversations, "
        "draftpipe.inference.prompting, draftpipe.formats.prompts, draftpipe.workflow.config; "
        "print(sorted(m for m in ('vllm', 'torch', 'transformers', 'pandas') if m in sys.modules))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert res.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def tokenizer(verifier_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(verifier_dir, local_files_only=True)


def test_required_chat_template_on_a_base_model(tokenizer, verifier_dir):
    assert tokenizer.chat_template is None  # stories260K is a base model
    assert check_chat_template(tokenizer, "auto") is False
    assert raised(ChatTemplateError, check_chat_template, tokenizer, "required") == (
        f"verifier.chat_template: 'required', but the tokenizer of the verifier {verifier_dir} has no chat template"
    )
    assert raised(ChatTemplateError, check_chat_template, tokenizer, "required", "org/base-model") == (
        "verifier.chat_template: 'required', but the tokenizer of the verifier org/base-model has no chat template"
    )
    assert raised(ValueError, check_chat_template, tokenizer, "always") == (
        "verifier.chat_template: unknown value 'always' (use auto or required)"
    )
    msgs = [{"role": "user", "content": "Once upon a time"}]
    assert raised(ChatTemplateError, encode_prompt, tokenizer, msgs, chat_template="required").startswith(
        "verifier.chat_template: 'required'"
    )
    records = [{"id": "a", "messages": msgs}]
    assert raised(
        ChatTemplateError,
        prepare_prompts,
        records,
        tokenizer,
        max_model_len=64,
        max_tokens=8,
        chat_template="required",
        verifier="results/verifier",
    ) == ("verifier.chat_template: 'required', but the tokenizer of the verifier results/verifier has no chat template")


def test_required_chat_template_is_used_when_present(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}]
    assert check_chat_template(tok, "required") is True
    ids = encode_prompt(tok, msgs, chat_template="required")
    assert tok.decode(ids) == "[system] Be brief.\n[user] Once upon a time\n[assistant]"
    _, stats = prepare_prompts(
        [{"id": "a", "messages": msgs}], tok, max_model_len=512, max_tokens=8, chat_template="required"
    )
    assert stats["last_user_turn_only"] == 0


def test_prepare_prompts_counts_too_long_and_multi_turn(tokenizer):
    short = [{"role": "user", "content": "Once upon a time"}]
    multi = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}]
    long_text = " ".join(["the little dog ran to the park"] * 40)
    long_ids = encode_prompt(tokenizer, [{"role": "user", "content": long_text}])
    short_ids = encode_prompt(tokenizer, short)
    assert len(short_ids) < 16 < 64 <= len(long_ids)
    assert encode_prompt(tokenizer, multi) == short_ids  # without a template: the last user message only
    records = [
        {"id": "short", "messages": short},
        {"id": "long", "messages": [{"role": "user", "content": long_text}]},
        {"id": "multi", "messages": multi},
    ]

    kept, stats = prepare_prompts(records, tokenizer, max_model_len=64, max_tokens=100)
    assert [(r["id"], len(ids), room, cut) for r, ids, room, cut in kept] == [
        ("short", len(short_ids), 64 - len(short_ids), False),
        ("multi", len(short_ids), 64 - len(short_ids), False),
    ]
    assert stats == {
        "prompts": 3,
        "kept": 2,
        "dropped_too_long": 1,
        "skipped_too_long": 1,
        "truncated_too_long": 0,
        "last_user_turn_only": 1,
    }

    kept, stats = prepare_prompts(records, tokenizer, max_model_len=64, max_tokens=100, too_long="truncate")
    rec, ids, room, cut = kept[1]
    assert rec["id"] == "long" and ids == long_ids[:32] and room == 32 and cut is True  # reserve = 64 // 2
    kept, _ = prepare_prompts(records, tokenizer, max_model_len=64, max_tokens=10, too_long="truncate")
    assert kept[1][1] == long_ids[:54] and kept[1][2] == 10  # reserve = max_tokens
    assert stats == {
        "prompts": 3,
        "kept": 3,
        "dropped_too_long": 0,
        "skipped_too_long": 0,
        "truncated_too_long": 1,
        "last_user_turn_only": 1,
    }

    assert raised(
        PromptTooLongError, prepare_prompts, records, tokenizer, max_model_len=64, max_tokens=8, too_long="error"
    ) == (
        f"completions.too_long: prompt long has {len(long_ids)} tokens, which leaves no room for a new token in "
        "verifier.max_model_len=64 (set completions.too_long to drop or truncate to go on)"
    )
    # a record read from a source is named by its file and line
    records[1].update(source="data/stories.jsonl", line=7)
    assert raised(
        PromptTooLongError, prepare_prompts, records, tokenizer, max_model_len=64, max_tokens=8, too_long="error"
    ).startswith("completions.too_long: prompt data/stories.jsonl:7 (id long) has ")
    assert raised(ValueError, prepare_prompts, [], tokenizer, max_model_len=64, max_tokens=8, too_long="cut") == (
        "completions.too_long: unknown policy 'cut' (use drop, truncate or error)"
    )


def test_unquoted_reasoning_off_means_off(shipped_config):
    import yaml

    cfg = copy.deepcopy(shipped_config)
    cfg["completions"]["reasoning"] = yaml.safe_load("reasoning: off")["reasoning"]
    assert cfg["completions"]["reasoning"] is False  # YAML 1.1
    validate_config(cfg)
    assert cfg["completions"]["reasoning"] == "off"


# ------------------------------------------------------------------------------------ an empty training set


def test_a_prompt_set_with_nothing_to_train_on_fails_when_the_workflow_is_read(tmp_path):
    from draftpipe.workflow.fingerprint import NoTrainingPromptsError, prompt_fingerprints

    source = tmp_path / "system_only.jsonl"
    source.write_text(
        json.dumps({"messages": [{"role": "system", "content": "You are kind."}]})
        + "\n"
        + json.dumps({"messages": [{"role": "system", "content": "You are kind."}]})
        + "\n"
    )
    assert raised(NoTrainingPromptsError, prompt_fingerprints, [{"path": str(source)}], 0.25, 2, 0) == (
        f"prompts.sources: no prompt to train on: 2 record(s) read from 1 source(s), 2 without a prompt to answer "
        f"(the first at {source}:1), 0 duplicate(s), 0 kept, 0 of them in the eval split (prompts.eval_fraction); "
        "a record needs a user turn, or text under its field"
    )
    # one prompt, but in the eval split: still nothing to train on
    source.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    assert raised(NoTrainingPromptsError, prompt_fingerprints, [{"path": str(source)}], 0.99, 2, 0).endswith(
        "0 without a prompt to answer, 0 duplicate(s), 1 kept, 1 of them in the eval split (prompts.eval_fraction); "
        "a record needs a user turn, or text under its field"
    )
    fp = prompt_fingerprints([{"path": str(source)}], 0.0, 2, 0)
    assert (fp["prompts"], fp["train_prompts"], len(fp["train"])) == (1, 1, 2)


def test_the_draft_job_trains_only_above_the_floor():
    from draftpipe.core.gates import QualityGateError, check_train_samples

    shards = [f"results/hidden_states/train_{i:05d}.safetensors" for i in range(4)]
    assert raised(QualityGateError, check_train_samples, [0, 0, 0], 1, shards) == (
        "draft: 0 of 3 training samples have a token to learn in 4 hidden-state shard(s) "
        "(results/hidden_states/train_00000.safetensors, results/hidden_states/train_00001.safetensors, "
        "results/hidden_states/train_00002.safetensors, ...), below draft.min_train_samples=1; "
        "results/prompts/stats.json and results/completions/stats.json say what was dropped"
    )
    assert raised(QualityGateError, check_train_samples, [], 1, shards[:1]).startswith(
        "draft: 0 of 0 training samples have a token to learn in 1 hidden-state shard(s) "
        "(results/hidden_states/train_00000.safetensors), below"
    )
    assert check_train_samples([5, 0, 7], 2, shards) == 2
    with pytest.raises(QualityGateError, match="below draft.min_train_samples=3"):
        check_train_samples([5, 0, 7], 3, shards)


def test_a_gzip_file_without_gz_in_its_name_is_named_so(tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(gzip.compress(jsonl({"prompt": "Once upon a time"})))
    assert raised(PromptFormatError, load_prompts, [{"path": str(source)}]) == (
        f"{source}: gzip-compressed data in a file not named .gz; rename it prompts.jsonl.gz (it is then "
        "decompressed) or decompress it"
    )
    renamed = source.rename(tmp_path / "prompts.jsonl.gz")
    records, _ = load_prompts([{"path": str(renamed)}])
    assert [r["messages"] for r in records] == [[{"role": "user", "content": "Once upon a time"}]]
    assert raised(IsADirectoryError, load_prompts, [{"path": str(tmp_path)}]) == (
        f"prompt source {tmp_path} is a directory, not a file: list each of its files as a source"
    )


def test_the_developer_role_is_the_system_turn():
    record = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    assert normalise_record(record, "f.jsonl:1") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_the_live_check_and_the_benchmark_apply_the_completions_length_policy():
    from draftpipe.inference.prompting import fit_prompts

    rows = [
        ({"id": "a", "source": "p.jsonl", "line": 1}, [1] * 10),
        ({"id": "b", "source": "p.jsonl", "line": 2}, [2] * 30),
    ]
    kept, stats = fit_prompts(rows, max_model_len=40, room=16, too_long="drop", stage="the live check")
    assert [r["id"] for r, _ in kept] == ["a"]
    assert stats == {"prompts": 2, "kept": 1, "dropped_too_long": 1, "truncated_too_long": 0}
    kept, stats = fit_prompts(rows, max_model_len=40, room=16, too_long="truncate", stage="the live check")
    assert [len(ids) for _, ids in kept] == [10, 24] and stats["truncated_too_long"] == 1
    assert raised(
        PromptTooLongError, fit_prompts, rows, max_model_len=40, room=16, too_long="error", stage="the benchmark"
    ) == (
        "completions.too_long: prompt p.jsonl:2 (id b) has 30 tokens, which leaves no room for the 16 new token(s) "
        "of the benchmark in verifier.max_model_len=40 (set completions.too_long to drop or truncate to go on)"
    )


def test_a_failed_live_check_reports_vllm_s_error_whole():
    from draftpipe.checks.compat.live import add_live_findings
    from draftpipe.checks.compat.report import Report, render_markdown

    error = (
        'Traceback (most recent call last):\n  File "x.py", line 3, in <module>\n    raise e\n'
        "vllm.exceptions.VLLMValidationError: The decoder prompt (length 600) is longer than the maximum model "
        "length of 512. Make sure that `max_model_len` is no smaller than the number of text tokens.\n"
    )
    rep = Report(draft="results/draft", verifier="results/verifier")
    add_live_findings(rep, {"error": error})
    [finding] = [f for f in rep.findings if f.id == "live.load"]
    assert finding.message == (
        "vLLM failed to load or run the draft with the verifier: vllm.exceptions.VLLMValidationError: The decoder "
        "prompt (length 600) is longer than the maximum model length of 512. Make sure that `max_model_len` is no "
        "smaller than the number of text tokens."
    )
    assert error.strip() in render_markdown(rep)


def test_the_live_check_and_the_benchmark_encode_and_fit_their_prompts(tokenizer):
    from draftpipe.inference.prompting import encode_and_fit

    short = [{"role": "user", "content": "Once upon a time"}]
    long_text = " ".join(["the little dog ran to the park"] * 40)
    records = [{"id": "s", "messages": short}, {"id": "l", "messages": [{"role": "user", "content": long_text}]}]
    ids = encode_prompt(tokenizer, short)
    kw = dict(template_kwargs={}, max_model_len=64, too_long="drop", stage="the benchmark")
    kept, stats = encode_and_fit(tokenizer, records, room=16, **kw)
    assert [(r["id"], i) for r, i in kept] == [("s", ids)] and stats["dropped_too_long"] == 1
    # more room than the context holds: as much as a prompt can leave (63 of 64), so no prompt of 2+ tokens fits
    kept, stats = encode_and_fit(tokenizer, records[:1], room=10**6, **kw)
    assert len(ids) > 1 and kept == [] and stats["dropped_too_long"] == 1


def test_config_files_name_the_file_and_line_of_a_yaml_error(tmp_path, capsys):
    from draftpipe.workflow.config import check_config_files, load_config_file, main

    tab = tmp_path / "tab.yaml"
    tab.write_text("completions:\n  seed: 1\n\tmax_tokens: 8\n")
    assert raised(ConfigError, load_config_file, tab) == (
        f"{tab}:3:1: a tab indents this line; YAML indents with spaces only"
    )
    indent = tmp_path / "indent.yaml"
    indent.write_text("completions:\n  seed: 1\n   max_tokens: 8\n")
    assert raised(ConfigError, load_config_file, indent) == (
        f"{indent}:3:14: not valid YAML (mapping values are not allowed here)"
    )
    listed = tmp_path / "list.yaml"
    listed.write_text("- completions\n")
    assert raised(ConfigError, load_config_file, listed) == f"{listed}: a config holds keys at its top level, not list"
    assert raised(ConfigError, load_config_file, tmp_path / "none.yaml") == f"{tmp_path / 'none.yaml'}: does not exist"
    # config.yaml extended by --configfile files, as Snakemake merges them, then the schema
    over = tmp_path / "over.yaml"
    over.write_text("completions:\n  max_tokens: 8\n")
    merged = check_config_files([over], REPO / "config.yaml")
    assert merged["completions"]["max_tokens"] == 8 and merged["completions"]["too_long"] == "drop"
    over.write_text("completions:\n  temprature: 0.5\n")
    assert main([str(over), "--base", str(REPO / "config.yaml")]) == 1
    assert capsys.readouterr().out.startswith("config error: completions.temprature: unknown key (known keys: ")
    assert main([str(tab), "--base", str(REPO / "config.yaml")]) == 1
    assert (
        capsys.readouterr().out == f"config error: {tab}:3:1: a tab indents this line; YAML indents with spaces only\n"
    )
    assert main(["--base", str(REPO / "config.yaml")]) == 0 and capsys.readouterr().out == "ok\n"


ALPACA = [  # Alpaca's shape: the task in `instruction`, its data in `input` (often empty), the answer in `output`
    {"instruction": "Sort the numbers in ascending order.", "input": "3, 1, 2", "output": "1, 2, 3"},
    {"instruction": "Name a primary color.", "input": "", "output": "Red."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
]


def test_a_source_combines_fields_or_fills_a_template(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    path.write_bytes(jsonl(*ALPACA))

    def prompts(**mapping):
        records, stats = load_prompts([{"path": str(path), **mapping}])
        return [r["messages"][-1]["content"] for r in sorted(records, key=lambda r: r["line"])], stats

    texts, stats = prompts(field=["instruction", "input"])  # non-empty texts joined by a blank line
    assert texts == [
        "Sort the numbers in ascending order.\n\n3, 1, 2",
        "Name a primary color.",
        "Translate to French.\n\nGood morning",
    ]
    assert stats.warnings == [] and "ignored_text" not in stats.per_source[str(path)]  # `output`: the answer
    texts, _ = prompts(template="{instruction}\n\nInput: {input}")
    assert (
        texts[0] == "Sort the numbers in ascending order.\n\nInput: 3, 1, 2"
        and texts[1] == "Name a primary color.\n\nInput: "
    )
    assert raised(PromptFormatError, prompts, template="{instruction} {context}") == (
        f"{path}:1: record has no key 'context', which the template names (its keys: 'input', 'instruction', 'output')"
    )
    assert raised(PromptFormatError, prompts, field=["question", "context"]) == (
        f"{path}:1: record has none of the keys 'question', 'context' (its keys: 'input', 'instruction', 'output')"
    )


def test_text_a_mapping_leaves_out_is_a_warning(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    path.write_bytes(jsonl(*ALPACA))
    records, stats = load_prompts([{"path": str(path), "field": "instruction"}])
    assert len(records) == 3 and stats.per_source[str(path)]["ignored_text"] == {"input": 2}
    assert stats.warnings == [
        f"prompts.sources[0] ({path}): 2 of 3 record(s) have text under 'input', which field 'instruction' leaves out "
        f"of the prompt (the first at {path}:1); to keep it, combine the keys (field: [instruction, input]) or write "
        "a template; to silence this, add ignore: [input]"
    ]
    _, stats = load_prompts([{"path": str(path), "field": "instruction", "ignore": ["input"]}])
    assert stats.warnings == []
    # the auto-detected `prompt` key: other text is named too; ids and answers are not
    other = tmp_path / "humaneval_like.jsonl"
    other.write_bytes(
        jsonl({"task_id": "T/0", "prompt": "def f():", "canonical_solution": "  pass", "test": "assert f() is None"})
    )
    _, stats = load_prompts([{"path": str(other)}])
    assert stats.per_source[str(other)]["ignored_text"] == {"test": 1}
    assert "which the 'prompt' key leaves out" in stats.warnings[0] and "(field: [prompt, test])" in stats.warnings[0]
    # chat records are whole conversations: nothing to warn about
    chat = tmp_path / "chat.jsonl"
    chat.write_bytes(jsonl({"messages": [{"role": "user", "content": "hi"}], "model": "gpt", "note": "x"}))
    assert load_prompts([{"path": str(chat)}])[1].warnings == []


def test_a_file_listed_twice_with_different_fields_has_an_entry_per_listing(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    path.write_bytes(jsonl(*ALPACA))
    records, stats = load_prompts([{"path": str(path), "field": "instruction"}, {"path": str(path), "field": "input"}])
    assert stats.per_source == {
        f"{path} (prompts.sources[0])": {"read": 3, "kept": 3, "ignored_text": {"input": 2}},
        f"{path} (prompts.sources[1])": {"read": 3, "empty": 1, "kept": 2, "ignored_text": {"instruction": 3}},
    }
    assert sum(s["kept"] for s in stats.per_source.values()) == stats.kept == len(records) == 5


@pytest.mark.parametrize(
    "source,expected",
    [
        ({"field": "instruction", "template": "{instruction}"}, "prompts.sources[0]: give field or template, not both"),
        (
            {"template": "{0} and {instruction!r}"},
            "prompts.sources[0].template: not a valid template ({0} is not a plain key (write {key} with a record "
            "key's name)); literal braces are written {{ and }}",
        ),
        (
            {"template": "no keys"},
            "prompts.sources[0].template: names no record key (write {key} where a record key's text goes)",
        ),
    ],
    ids=["field-and-template", "positional-template", "template-without-keys"],
)
def test_source_mapping_errors_name_the_key(fake_verifier, source, expected):
    cfg = base_config()
    cfg["prompts"]["sources"] = [{"path": str(TINYSTORIES), **source}]
    assert raised(ConfigError, check_config, cfg, fake_verifier) == expected


@pytest.mark.parametrize("key", ["completions.seed", "draft.seed"])
def test_a_seed_beyond_32_bits_is_refused_when_the_workflow_is_read(shipped_config, key):
    cfg = _set(copy.deepcopy(shipped_config), key, 2**32)
    assert raised(ConfigError, validate_config, cfg) == f"{key}: 4294967296 is greater than the maximum of 4294967295"
    assert raised(ConfigError, validate_config, _set(copy.deepcopy(shipped_config), key, -1)) == (
        f"{key}: -1 is less than the minimum of 0"
    )
    validate_config(_set(copy.deepcopy(shipped_config), key, 2**32 - 1))


def test_a_source_path_under_the_home_directory_is_expanded_as_the_verifier_s_is(shipped_config, tmp_path, monkeypatch):
    """Issue 28: ``~/p.jsonl`` "did not exist" while ``verifier.path`` expands ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "p.jsonl").write_bytes(jsonl(OK))
    cfg = copy.deepcopy(shipped_config)
    cfg["prompts"]["sources"] = [{"path": "~/p.jsonl"}]
    cfg["bench"]["prompt_sets"] = [{"name": "home", "path": "~/p.jsonl"}]
    validate_config(cfg)
    assert cfg["prompts"]["sources"][0]["path"] == str(tmp_path / "p.jsonl")
    assert cfg["bench"]["prompt_sets"][0]["path"] == str(tmp_path / "p.jsonl")


@pytest.mark.parametrize(
    "weights,expected",
    [
        ('{"ce": -1}', "draft.loss_fn: the weight of 'ce' is -1; a weight must be finite and above 0"),
        ('{"ce": NaN}', "draft.loss_fn: the weight of 'ce' is nan; a weight must be finite and above 0"),
        (
            '{"ce": 0.5, "tv": Infinity}',
            "draft.loss_fn: the weight of 'tv' is inf; a weight must be finite and above 0",
        ),
        ('{"ce": 0}', "draft.loss_fn: the weight of 'ce' is 0; a weight must be finite and above 0"),
    ],
    ids=["negative", "nan", "infinite", "zero"],
)
def test_loss_weights_that_train_nothing_useful_are_refused(shipped_config, weights, expected):
    """``{"ce": -1}`` trained the embedded default to a loss of -164 with exit 0; NaN failed minutes into the job."""
    cfg = copy.deepcopy(shipped_config)
    cfg["draft"]["loss_fn"] = weights
    message = raised(ConfigError, validate_config, cfg)
    assert message.startswith(expected), message
    cfg["draft"]["loss_fn"] = '{"ce": 0.1, "tv": 0.9}'
    validate_config(cfg)


def test_numbers_nested_in_a_config_option_are_read_as_numbers(shipped_config):
    """``snakemake --config 'draft={"epochs": 3}'`` hands the workflow strings ('3' is not of type 'integer'
    before): the values are read as the schema's types, through Snakemake's own parser of the option."""
    from snakemake.cli import parse_config
    from snakemake.utils import update_config

    given = parse_config(
        ['draft={"epochs": 3, "lr": 1e-4, "head_dim": null}', 'hidden_states={"aux_layer_ids": [1, 2, 4]}']
    )
    assert given["draft"]["epochs"] == "3" and given["hidden_states"]["aux_layer_ids"] == ["1", "2", "4"]
    cfg = copy.deepcopy(shipped_config)
    update_config(cfg, given)
    validate_config(cfg)
    assert (cfg["draft"]["epochs"], cfg["draft"]["lr"], cfg["draft"]["head_dim"]) == (3, 0.0001, None)
    assert cfg["hidden_states"]["aux_layer_ids"] == [1, 2, 4]
    # a string the schema takes stays a string; one that reads as no number is named by the schema
    update_config(cfg, parse_config(['verifier={"path": "123"}', 'draft={"epochs": "three"}']))
    assert raised(ConfigError, validate_config, cfg) == "draft.epochs: 'three' is not of type 'integer'"
    assert cfg["verifier"]["path"] == "123"


def test_a_verifier_config_json_that_cannot_be_read_is_a_config_error(tmp_path):
    """It was a Python traceback from rules/common.smk: invalid JSON, JSON nested too deeply, no layer count."""
    d = tmp_path / "verifier"
    d.mkdir()
    verifier = {"kind": "local", "path": str(d)}
    cfg = base_config()
    (d / "config.json").write_text('{"num_hidden_layers": 5,')
    assert raised(ConfigError, check_config, cfg, verifier) == (
        f"verifier.path: {d / 'config.json'}: not valid JSON (Expecting property name enclosed in double quotes)"
    )
    (d / "config.json").write_text("[" * 200 + "]" * 200)
    assert raised(ConfigError, check_config, cfg, verifier) == (
        f"verifier.path: {d / 'config.json'}: JSON nested more than 64 levels deep"
    )
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": "5", "vocab_size": 512, "hidden_size": 64}))
    assert raised(ConfigError, check_config, cfg, verifier) == (
        f"verifier.path: {d / 'config.json'} does not give num_hidden_layers as a positive integer (got '5'); is it "
        "the config.json of a text model?"
    )


def test_a_bench_prompt_set_that_is_a_directory_is_named_so(fake_verifier, tmp_path):
    cfg = _set(base_config(), "bench.prompt_sets", [{"name": "mt", "path": str(tmp_path)}])
    assert raised(ConfigError, check_config, cfg, fake_verifier) == (
        f"bench.prompt_sets[0].path: {tmp_path} is a directory, not a file: name one prompt file per prompt set"
    )
