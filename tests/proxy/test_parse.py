"""Completion text → thinking, text and tool calls, however the stream is chunked."""

from __future__ import annotations

import itertools

import pytest
from proxy_harness import tokenizer

from legorl.proxy.chat import TextDelta, ThinkingDelta, ToolCallEvent
from legorl.proxy.parse import Detokenizer, OutputParser, parse_tool_call

QWEN = (
    "<think>\nThe test fails on area.\nLook first.\n</think>\n\nLet me look.\n"
    '<tool_call>\n{"name": "bash", "arguments": {"command": "cat geo.py", "timeout": 5}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name":"edit","arguments":{"path":"geo.py","old":"w + h","new":"w * h"}}\n</tool_call>'
)
CODER_XML = (
    "I will edit it.\n<tool_call>\n<function=edit>\n<parameter=path>\ngeo.py\n</parameter>\n"
    "<parameter=count>\n3\n</parameter>\n<parameter=new>\nreturn w * h\n</parameter>\n"
    "</function>\n</tool_call>"
)


def _parse(text: str, step: int) -> OutputParser:
    ids = itertools.count()
    parser = OutputParser(lambda: f"call_{next(ids)}")
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    # Deltas add up to what the parser reports in total.
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "".join(parser.text)
    assert "".join(e.text for e in events if isinstance(e, ThinkingDelta)) == "".join(
        parser.thinking
    )
    assert [e.call for e in events if isinstance(e, ToolCallEvent)] == parser.calls
    return parser


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 13, 10_000])
def test_qwen_thinking_text_and_two_calls_at_any_chunking(step: int) -> None:
    parser = _parse(QWEN, step)
    assert "".join(parser.thinking) == "The test fails on area.\nLook first."
    assert "".join(parser.text) == "Let me look."
    assert [(c.name, c.arguments) for c in parser.calls] == [
        ("bash", '{"command": "cat geo.py", "timeout": 5}'),
        ("edit", '{"path":"geo.py","old":"w + h","new":"w * h"}'),  # the model's own text
    ]
    assert [c.id for c in parser.calls] == ["call_0", "call_1"]
    assert not parser.malformed


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_qwen3_coder_xml_calls(step: int) -> None:
    parser = _parse(CODER_XML, step)
    assert "".join(parser.text) == "I will edit it."
    (call,) = parser.calls
    assert call.name == "edit"
    assert call.arguments == '{"path":"geo.py","count":3,"new":"return w * h"}'


@pytest.mark.parametrize(
    "text",
    [
        "before <tool_call>{not json}</tool_call> after",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "x", "arguments": {"a": 1}',  # never closed
    ],
)
def test_malformed_calls_come_back_as_text_and_flagged(text: str) -> None:
    parser = _parse(text, 3)
    assert parser.malformed and parser.calls == []
    assert "<tool_call>" in "".join(parser.text)


def test_tag_prefixes_are_held_back_not_lost() -> None:
    parser = _parse("a < b and <tool but not a call; <thinking aloud", 1)
    assert "".join(parser.text) == "a < b and <tool but not a call; <thinking aloud"
    assert parser.calls == [] and not parser.malformed


def test_arguments_given_as_a_json_string_are_decoded() -> None:
    assert parse_tool_call('{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}') == (
        "bash",
        '{"command":"ls"}',
    )


def test_detokenizer_matches_a_full_decode_one_token_at_a_time() -> None:
    tok = tokenizer()
    text = "naïve café — 数据 🚀 done<|im_end|>"
    ids = tok.encode(text)
    detok = Detokenizer(tok.decode, tok.special_ids)
    out = "".join(detok.push([i]) for i in ids)
    assert out == "naïve café — 数据 🚀 done"
