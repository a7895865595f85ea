"""The proxy core through a real HTTP server: token fidelity across re-serialised history,
segments, auxiliary sub-sessions, serialised sessions, and every bad input in its API's shape.

The engine is `forced`, a fake that ships in the package: it replays scripted completions and
computes every log-prob with a real forward pass of the tiny model.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import math
import socket
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from proxy_harness import MODEL, running_proxy, tokenizer

from legorl.engines.models import load_model, token_logprobs
from legorl.records import segment_prompts

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    }
]
THINK_AND_CALL = (
    "<think>\nI should look at the files first.\n</think>\n\n"
    '<tool_call>\n{"name":"bash","arguments":{"command":"ls -la","timeout":5}}\n</tool_call>'
)
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
USER = {"role": "user", "content": "List the files, then say done."}


def _chat(url: str, session: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/s/{session}/v1/chat/completions", json=body, timeout=60)


def test_reserialised_history_keeps_the_raw_tokens_in_one_segment(tmp_path: Path) -> None:
    script = [{"text": THINK_AND_CALL}, {"text": "Done: two files."}]
    with running_proxy(tmp_path, script) as proxy:
        first = _chat(
            proxy.url, "s1", {"model": "gpt-5", "messages": [SYSTEM, USER], "tools": TOOLS}
        )
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        assert message["reasoning_content"] == "I should look at the files first."
        (call,) = message["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"command": "ls -la", "timeout": 5}
        # The harness sends the call back re-printed (other key order, spaces) without thinking.
        history = [
            SYSTEM,
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {
                            "name": "bash",
                            "arguments": '{"timeout": 5, "command": "ls -la"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "a.py\nb.py"},
        ]
        second = _chat(proxy.url, "s1", {"model": "gpt-5", "messages": history, "tools": TOOLS})
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["message"]["content"] == "Done: two files."
        turns = proxy.turns("s1")

    tok = tokenizer()
    assert [t.segment for t in turns] == [0, 0]
    assert turns[0].segment_reason == "start" and turns[1].segment_reason is None
    assert turns[0].completion_ids == tok.encode(THINK_AND_CALL) + [tok.eos_id]
    assert turns[1].completion_ids == tok.encode("Done: two files.") + [tok.eos_id]
    assert turns[1].flags.realigned == 1
    (_, p0), (_, p1) = segment_prompts(turns)
    # The second prompt is the first prompt, the raw sampled tokens, then only the new messages.
    assert p1[: len(p0) + len(turns[0].completion_ids)] == p0 + turns[0].completion_ids
    assert turns[1].prompt_offset == len(p0) + len(turns[0].completion_ids)
    assert tok.decode(turns[1].prompt_delta).startswith("\n<|im_start|>user\n<tool_response>")
    # A naive re-render of the harness's history gives other tokens: the repair is needed.
    from legorl.proxy.chat import Message, Tool, ToolCall

    naive_msgs = [
        Message(role="system", content=SYSTEM["content"]),
        Message(role="user", content=USER["content"]),
        Message(
            role="assistant",
            tool_calls=[
                ToolCall(
                    id=call["id"], name="bash", arguments='{"timeout": 5, "command": "ls -la"}'
                )
            ],
        ),
        Message(role="tool", content="a.py\nb.py", tool_call_id=call["id"]),
    ]
    naive = tok.full_prompt(
        naive_msgs,
        [
            Tool(
                name="bash",
                parameters=TOOLS[0]["function"]["parameters"],
                description="Run a shell command.",
            )
        ],
    )
    assert naive != p1
    # Every recorded log-prob is the model's own, recomputed here with one forward pass.
    model = load_model(str(MODEL), dtype="float32", device="cpu")
    for prompt, turn in ((p0, turns[0]), (p1, turns[1])):
        again = token_logprobs(
            model, prompt + turn.completion_ids, start=len(prompt), temperature=1.0
        )
        assert max(abs(a - b) for a, b in zip(again, turn.completion_logprobs, strict=True)) < 1e-4


def test_compaction_opens_a_second_segment(tmp_path: Path) -> None:
    script = [{"text": THINK_AND_CALL}, {"text": "Summary noted.", "repeat": True}]
    with running_proxy(tmp_path, script) as proxy:
        first = _chat(proxy.url, "s2", {"model": "m", "messages": [SYSTEM, USER], "tools": TOOLS})
        call = first.json()["choices"][0]["message"]["tool_calls"][0]
        compacted = [SYSTEM, {"role": "user", "content": "Summary: you ran ls. Continue."}]
        assert (
            _chat(
                proxy.url, "s2", {"model": "m", "messages": compacted, "tools": TOOLS}
            ).status_code
            == 200
        )
        assert call["id"]
        turns = proxy.turns("s2")
    assert [t.segment for t in turns] == [0, 1]
    assert turns[1].prompt_offset == 0
    assert turns[1].segment_reason == "history rewritten at message 1"


def test_calls_without_tools_go_to_an_aux_sub_session(tmp_path: Path) -> None:
    script = [
        {"match": "Generate a title", "text": "Listing files", "repeat": True},
        {"text": "ok", "repeat": True},
    ]
    with running_proxy(tmp_path, script) as proxy:
        title = _chat(
            proxy.url,
            "s3",
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "Generate a title for the conversation."},
                    USER,
                ],
            },
        )
        main = _chat(proxy.url, "s3", {"model": "m", "messages": [SYSTEM, USER], "tools": TOOLS})
        assert title.status_code == main.status_code == 200
        turns = proxy.turns("s3")
    by_aux = {t.flags.aux: t for t in turns}
    assert by_aux[True].session.startswith("s3~aux-") and by_aux[True].parent_session == "s3"
    assert by_aux[True].output.text == "Listing files"
    assert by_aux[False].session == "s3" and by_aux[False].parent_session is None


def test_parallel_calls_of_one_session_never_interleave(tmp_path: Path) -> None:
    script = [{"text": "word " * 40, "repeat": True}]
    with running_proxy(tmp_path, script, engine_chunk_tokens=1) as proxy:
        body = {"model": "m", "messages": [SYSTEM, USER], "stream": True}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: _chat(proxy.url, "s4", body), range(4)))
        assert all(r.status_code == 200 for r in results)
        turns = proxy.turns("s4")
    assert sorted(t.turn for t in turns) == [0, 1, 2, 3]
    spans = sorted(
        (t.time + t.timings["queue_s"], t.time + t.timings["queue_s"] + t.timings["generate_s"])
        for t in turns
    )
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end - 1e-3, "two calls of one session ran at once"


def test_streaming_sends_tokens_as_they_come(tmp_path: Path) -> None:
    script = [{"text": "one two three four five six seven eight"}]
    with running_proxy(tmp_path, script, engine_chunk_tokens=1) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        body = json.dumps({"model": "m", "messages": [USER], "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"POST /s/s5/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(body), body)
            )
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    deltas = [ln for ln in payload.split(b"\n") if ln.startswith(b"data: {")]
    assert len(deltas) >= 8  # one HTTP chunk per streamed token, not one body at the end
    assert payload.rstrip().endswith(b"0")


def test_official_sdks_parse_every_answer(tmp_path: Path) -> None:
    script = [{"text": THINK_AND_CALL, "repeat": True}]
    with running_proxy(tmp_path, script) as proxy:
        oai = openai.OpenAI(base_url=f"{proxy.url}/s/s6/v1", api_key="x")
        done = oai.chat.completions.create(model="gpt-5", messages=[USER], tools=TOOLS)
        assert done.choices[0].finish_reason == "tool_calls"
        assert done.choices[0].message.tool_calls[0].function.name == "bash"
        assert done.model == "gpt-5"
        chunks = list(
            oai.chat.completions.create(
                model="gpt-5",
                messages=[USER],
                tools=TOOLS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        resp = oai.responses.create(
            model="gpt-5",
            input="list files",
            tools=[
                {
                    "type": "function",
                    "name": "bash",
                    "parameters": TOOLS[0]["function"]["parameters"],
                }
            ],
        )
        assert [item.type for item in resp.output][-1] == "function_call"
        ant = anthropic.Anthropic(base_url=f"{proxy.url}/s/s7", api_key="x")
        tools = [
            {
                "name": "bash",
                "description": "Run",
                "input_schema": TOOLS[0]["function"]["parameters"],
            }
        ]
        msg = ant.messages.create(
            model="claude-x",
            max_tokens=200,
            tools=tools,
            thinking={"type": "enabled", "budget_tokens": 100},
            messages=[{"role": "user", "content": "list files"}],
        )
        assert [b.type for b in msg.content] == ["thinking", "tool_use"]
        assert msg.content[1].input == {"command": "ls -la", "timeout": 5}
        assert msg.stop_reason == "tool_use"
        with ant.messages.stream(
            model="claude-x",
            max_tokens=200,
            tools=tools,
            thinking={"type": "enabled", "budget_tokens": 100},
            messages=[{"role": "user", "content": "list files"}],
        ) as stream:
            final = stream.get_final_message()
        assert final.content[-1].type == "tool_use" and final.stop_reason == "tool_use"
        counted = ant.messages.count_tokens(
            model="claude-x", tools=tools, messages=[{"role": "user", "content": "list files"}]
        )
    # count_tokens is exact: the transformers template render, tokenised.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(MODEL)
    text = hf.apply_chat_template(
        [{"role": "user", "content": "list files"}],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "description": "Run",
                    "parameters": TOOLS[0]["function"]["parameters"],
                },
            }
        ],
        tokenize=False,
    )
    assert counted.input_tokens == len(hf(text, add_special_tokens=False)["input_ids"])


# ---- bad input: the status and the error body in the calling API's own shape ----------------


def _openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def _anthropic_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and {"type", "message"} <= set(body["error"])
    return body["error"]


def test_bad_requests_get_errors_in_their_apis_shape(tmp_path: Path) -> None:
    script = [{"text": "ok", "repeat": True}]
    with running_proxy(
        tmp_path,
        script,
        engine_max_context=256,
        max_body_bytes=200_000,
        open_sessions=False,
        admin_token="secret",
    ) as proxy:
        url = proxy.url
        ok = httpx.post(
            f"{url}/admin/sessions",
            json={"id": "known"},
            headers={"authorization": "Bearer secret"},
        )
        assert ok.status_code == 200
        route = ok.json()["route"]
        chat = f"{url}{route}/v1/chat/completions"
        messages = f"{url}{route}/v1/messages"
        err = _openai_error(httpx.post(chat, content=b"{nope"), 400)
        assert "not valid JSON" in err["message"]
        err = _anthropic_error(httpx.post(messages, content=b"{nope"), 400)
        assert err["type"] == "invalid_request_error"
        err = _openai_error(
            httpx.post(chat, json={"model": "m", "messages": [{"role": "user", "content": 5}]}), 400
        )
        assert err["param"] == "messages[0].content"
        err = _anthropic_error(httpx.post(messages, json={"model": "m", "messages": []}), 400)
        assert "max_tokens" in err["message"]
        err = _openai_error(
            httpx.post(
                f"{url}/s/ghost/v1/chat/completions", json={"model": "m", "messages": [USER]}
            ),
            404,
        )
        assert "unknown session 'ghost'" in err["message"]
        err = _anthropic_error(
            httpx.post(
                f"{url}/s/ghost/v1/messages",
                json={"model": "m", "max_tokens": 5, "messages": [USER]},
            ),
            404,
        )
        assert err["type"] == "not_found_error"
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 300_000}]}
        err = _openai_error(httpx.post(chat, json=big), 413)
        assert "exceeds the limit" in err["message"]
        long = {"model": "m", "messages": [{"role": "user", "content": "word " * 2000}]}
        err = _openai_error(httpx.post(chat, json=long), 400)
        assert err["code"] == "context_length_exceeded"
        err = _anthropic_error(httpx.post(messages, json={**long, "max_tokens": 5}), 400)
        assert err["message"].startswith("prompt is too long")
        err = _openai_error(
            httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": [USER]}), 401
        )
        assert "session" in err["message"]
        err = _openai_error(
            httpx.post(
                f"{url}/s/bad%20id/v1/chat/completions", json={"model": "m", "messages": [USER]}
            ),
            400,
        )
        _openai_error(httpx.post(f"{url}/admin/weights", json={"path": "/x"}), 401)
        assert proxy.turns("known") == []  # nothing bad was recorded


def test_api_key_is_the_session_and_plain_routes_answer(tmp_path: Path) -> None:
    script = [{"text": "ok", "repeat": True}]
    with running_proxy(tmp_path, script) as proxy:
        assert httpx.head(f"{proxy.url}/").status_code == 200
        assert httpx.head(f"{proxy.url}/s/abc").status_code == 200
        health = httpx.get(f"{proxy.url}/healthz").json()
        assert health["status"] == "ok" and health["engine"] == "forced"
        models = httpx.get(f"{proxy.url}/v1/models").json()
        assert models["data"][0]["id"] == "tiny-qwen3"
        resp = httpx.post(
            f"{proxy.url}/v1/messages",
            headers={"x-api-key": "keyed-session"},
            json={"model": "claude-opus-4", "max_tokens": 20, "messages": [USER]},
        )
        assert resp.status_code == 200 and resp.json()["model"] == "claude-opus-4"
        (turn,) = proxy.turns("keyed-session")
    assert turn.requested_model == "claude-opus-4" and turn.model == "tiny-qwen3"
    assert turn.api == "anthropic"
    assert all(math.isfinite(x) and x <= 0 for x in turn.completion_logprobs)


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_malformed_tool_call_is_text_and_flagged(tmp_path: Path, api: str) -> None:
    script = [{"text": "<tool_call>\n{not json}\n</tool_call>"}]
    with running_proxy(tmp_path, script) as proxy:
        if api == "chat":
            resp = _chat(proxy.url, "s8", {"model": "m", "messages": [USER], "tools": TOOLS})
            assert "{not json}" in resp.json()["choices"][0]["message"]["content"]
        else:
            resp = httpx.post(
                f"{proxy.url}/s/s8/v1/messages",
                json={
                    "model": "m",
                    "max_tokens": 50,
                    "messages": [USER],
                    "tools": [{"name": "bash", "input_schema": {"type": "object"}}],
                },
            )
            assert resp.json()["content"][0]["type"] == "text"
        assert resp.status_code == 200
        (turn,) = proxy.turns("s8")
    assert turn.flags.malformed_tool_call and turn.output.tool_calls == []


def test_weights_reload_under_load_drops_nothing(tmp_path: Path) -> None:
    # The embedded engine (real generation with the tiny model); a second checkpoint with the
    # same architecture and other weights.
    import torch

    ckpt = tmp_path / "ckpt"
    model = load_model(str(MODEL), dtype="float32", device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.save_pretrained(ckpt)
    with running_proxy(tmp_path / "turns", [], engine="embedded", admin_token="t0k") as proxy:
        body = {"model": "m", "max_tokens": 24, "temperature": 1.0, "messages": [USER]}

        def one(i: int) -> int:
            return _chat(proxy.url, f"w{i}", {**body, "stream": i % 2 == 0}).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(one, i) for i in range(8)]
            reload = httpx.post(
                f"{proxy.url}/admin/weights",
                json={"path": str(ckpt)},
                headers={"authorization": "Bearer t0k"},
                timeout=120,
            )
            statuses = [c.result() for c in calls]
        assert reload.status_code == 200 and reload.json() == {"policy_version": 1}
        assert statuses == [200] * 8
        after = _chat(proxy.url, "w-after", body)
        assert after.status_code == 200
        versions = {i: proxy.turns(f"w{i}")[0].policy_version for i in range(8)}
        (late,) = proxy.turns("w-after")
    assert set(versions.values()) <= {0, 1}
    assert late.policy_version == 1
    # Its log-probs are the new weights' (recomputed here), not the old ones'.
    ((_, prompt),) = segment_prompts([late])
    seq = prompt + late.completion_ids
    new = token_logprobs(model, seq, start=len(prompt), temperature=1.0)
    old = token_logprobs(load_model(str(MODEL)), seq, start=len(prompt), temperature=1.0)
    assert max(abs(a - b) for a, b in zip(new, late.completion_logprobs, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(old, late.completion_logprobs, strict=True)) > 1e-2
