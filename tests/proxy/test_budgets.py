"""Episode budgets at the proxy, through a real HTTP server and each API's own SDK client: the
per-call max_tokens clamp (the Turn keeps what was asked and what was used), the per-session
caps on calls, sampled tokens and seconds, and the context overflow, each of which ends the
episode with an error the SDK does not retry and marks the session truncated.

The engine is `forced`, a fake that ships in the package: it replays scripted completions and
computes every log-prob with a real forward pass of the tiny model.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from proxy_harness import MODEL, running_proxy

from legorl.proxy.core import CONTEXT_OVERFLOW, Budget

LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen."
USER = "List the files."


def _ask(api: str, url: str, session: str, *, stream: bool = False, max_tokens: int = 1024):
    """One call through the API's own SDK, retries on (so a retried refusal would show)."""
    if api == "anthropic":
        claude = anthropic.Anthropic(base_url=f"{url}/s/{session}", api_key="x", max_retries=2)
        messages = [{"role": "user", "content": USER}]
        if stream:
            with claude.messages.stream(
                model="claude-test", max_tokens=max_tokens, messages=messages
            ) as s:
                return s.get_final_message()
        return claude.messages.create(model="claude-test", max_tokens=max_tokens, messages=messages)
    oai = openai.OpenAI(base_url=f"{url}/s/{session}/v1", api_key="x", max_retries=2)
    if api == "openai_chat":
        return oai.chat.completions.create(
            model="gpt-test",
            messages=[{"role": "user", "content": USER}],
            max_tokens=max_tokens,
            stream=stream,
        )
    return oai.responses.create(
        model="gpt-test", input=USER, max_output_tokens=max_tokens, stream=stream
    )


def _consume(answer: object) -> None:
    # A streamed answer is only whole (and its Turn recorded) once read to the end.
    if isinstance(answer, (openai.Stream,)):
        for _ in answer:
            pass


def test_each_call_is_clamped_and_the_turn_keeps_asked_and_used(tmp_path: Path) -> None:
    script = [{"text": LONG}]
    with running_proxy(tmp_path / "capped", script, budget=Budget(max_call_tokens=5)) as proxy:
        _ask("anthropic", proxy.url, "s1", stream=True, max_tokens=64000)
        [turn] = proxy.turns("s1")
    assert turn.requested_max_tokens == 64000 and turn.max_tokens == 5
    assert len(turn.completion_ids) == 5 and turn.finish_reason == "length"
    # Control: without the cap the same call samples the whole scripted answer.
    with running_proxy(tmp_path / "free", script) as proxy:
        _ask("anthropic", proxy.url, "s1", stream=True, max_tokens=64000)
        [free] = proxy.turns("s1")
    assert free.requested_max_tokens == 64000 and free.max_tokens > 5
    assert len(free.completion_ids) > 5 and free.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("api", ["openai_chat", "anthropic", "responses"])
def test_a_call_past_max_turns_ends_the_episode_in_the_api_shape(
    tmp_path: Path, api: str, stream: bool
) -> None:
    with running_proxy(tmp_path, [{"text": "ok"}] * 2, budget=Budget(max_turns=1)) as proxy:
        _consume(_ask(api, proxy.url, "s1", stream=stream))
        before = proxy.core.stats["requests"]
        error = anthropic.BadRequestError if api == "anthropic" else openai.BadRequestError
        with pytest.raises(error) as refused:
            _consume(_ask(api, proxy.url, "s1", stream=stream))
        assert proxy.core.stats["requests"] == before + 1  # final: the SDK did not retry it
        assert "budget is spent" in str(refused.value) and "max_turns=1" in str(refused.value)
        if api != "anthropic":  # Anthropic's error shape has a type and a message only
            assert "budget_exceeded" in str(refused.value.body)
        assert len(proxy.turns("s1")) == 1
        # Another session has its own budget.
        _consume(_ask(api, proxy.url, "s2", stream=stream))
        assert proxy.call(_close(proxy.core, "s1")) == "max_turns"
        assert proxy.call(_close(proxy.core, "s2")) is None


async def _close(core, sid: str) -> str | None:
    report = core.close_session(sid)
    return report.truncated if report is not None else None


def test_the_episode_token_budget_clamps_then_refuses(tmp_path: Path) -> None:
    script = [{"text": LONG}, {"text": LONG}]
    with running_proxy(tmp_path, script, budget=Budget(max_tokens=7)) as proxy:
        _ask("openai_chat", proxy.url, "s1", max_tokens=4)
        _ask("openai_chat", proxy.url, "s1", max_tokens=64000)  # 3 tokens left of 7
        with pytest.raises(openai.BadRequestError, match="7 tokens sampled, max_tokens=7"):
            _ask("openai_chat", proxy.url, "s1")
        turns = proxy.turns("s1")
        assert [len(t.completion_ids) for t in turns] == [4, 3]
        assert [t.max_tokens for t in turns] == [4, 3]
        assert proxy.call(_close(proxy.core, "s1")) == "max_tokens"


def test_the_episode_wall_budget_refuses_a_later_call(tmp_path: Path) -> None:
    with running_proxy(tmp_path, [{"text": "ok"}], budget=Budget(max_s=0.5)) as proxy:
        _ask("responses", proxy.url, "s1")
        time.sleep(0.6)
        with pytest.raises(openai.BadRequestError, match=r"max_s=0\.5"):
            _ask("responses", proxy.url, "s1")
        assert proxy.call(_close(proxy.core, "s1")) == "max_s"


def test_a_context_overflow_marks_the_session_truncated(tmp_path: Path) -> None:
    with running_proxy(tmp_path, [{"text": "ok"}] * 2, engine_max_context=24) as proxy:
        _ask("openai_chat", proxy.url, "short")  # fits
        with pytest.raises(openai.BadRequestError) as refused:
            oai = openai.OpenAI(base_url=f"{proxy.url}/s/long/v1", api_key="x", max_retries=2)
            oai.chat.completions.create(
                model="gpt-test", messages=[{"role": "user", "content": LONG * 4}]
            )
        assert refused.value.code == "context_length_exceeded"
        assert proxy.call(_close(proxy.core, "long")) == CONTEXT_OVERFLOW
        assert proxy.call(_close(proxy.core, "short")) is None


def test_the_admin_api_reports_the_truncation_on_close(tmp_path: Path) -> None:
    budget = Budget(max_turns=1)
    with running_proxy(tmp_path, [{"text": "ok"}], admin_token="t0k", budget=budget) as proxy:
        auth = {"authorization": "Bearer t0k"}
        opened = httpx.post(f"{proxy.url}/admin/sessions", json={"id": "r1"}, headers=auth)
        route = opened.json()["route"]
        base = f"{proxy.url}{route}/v1/chat/completions"
        body = {"model": "m", "messages": [{"role": "user", "content": USER}]}
        assert httpx.post(base, json=body, timeout=60).status_code == 200
        refused = httpx.post(base, json=body, timeout=60)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "budget_exceeded"
        closed = httpx.delete(f"{proxy.url}/admin/sessions/r1", headers=auth)
        assert closed.json()["truncated"] == "max_turns"
        report = closed.json()["report"]
        assert report == {
            "truncated": "max_turns",
            "completions": 1,
            "engine_failures": [],
            "failed_last": False,
        }


def test_a_budget_that_is_not_positive_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match="max_turns: must be > 0"):
        Budget(max_turns=0)
    cli = [str(Path(sys.executable).with_name("legorl")), "proxy", "serve", "--model", str(MODEL)]
    done = subprocess.run(
        [*cli, "--max-episode-tokens", "0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "legorl proxy: error: --max-episode-tokens 0: must be > 0" in done.stderr


# ---- the session's report: what the proxy itself saw ---------------------------------------


def _chat(url: str, session: str, content: str, **extra: object) -> int:
    """The call's status; a streamed call's error comes after its 200, as an event: 503."""
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    resp = httpx.post(f"{url}/s/{session}/v1/chat/completions", json=body, timeout=120)
    return 503 if resp.status_code == 200 and "engine error" in resp.text else resp.status_code


async def _report(core, sid: str):
    return core.close_session(sid)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_the_report_says_whether_the_engine_failed_after_the_last_completion(
    tmp_path: Path, stream: bool
) -> None:
    # The forced engine fails a call that no scripted entry matches (an engine down, for the
    # proxy): 503. Whether that failure came after the policy's last completion is the report's.
    script = [{"match": "first", "text": "ok", "repeat": True}, {"match": "third", "text": "ok"}]
    with running_proxy(tmp_path, script) as proxy:
        assert _chat(proxy.url, "s1", "first", stream=stream) == 200
        assert _chat(proxy.url, "s1", "second", stream=stream) == 503
        failed = proxy.call(_report(proxy.core, "s1"))
        assert failed.completions == 1 and failed.failed_last
        assert "no scripted completion left" in failed.engine_failures[-1]
        assert _chat(proxy.url, "s2", "second", stream=stream) == 503
        assert _chat(proxy.url, "s2", "third", stream=stream) == 200
        recovered = proxy.call(_report(proxy.core, "s2"))
        assert recovered.completions == 1 and not recovered.failed_last
        assert len(recovered.engine_failures) == 1
        assert _chat(proxy.url, "s3", "first", stream=stream) == 200
        clean = proxy.call(_report(proxy.core, "s3"))
        assert clean.completions == 1 and not clean.failed_last and not clean.engine_failures


def test_a_refusal_of_what_the_request_asked_is_not_an_engine_failure(tmp_path: Path) -> None:
    # The embedded engine (the real tiny model) refuses a negative temperature: the request's
    # doing, which a client in the sandbox chooses, so the report does not count it.
    with running_proxy(tmp_path, [], engine="embedded") as proxy:
        assert _chat(proxy.url, "s1", "hello", temperature=-1.0) == 503
        refused = proxy.call(_report(proxy.core, "s1"))
        assert refused.completions == 0 and not refused.engine_failures
        assert not refused.failed_last
        assert _chat(proxy.url, "s2", "hello", max_tokens=2) == 200
        assert proxy.call(_report(proxy.core, "s2")).completions == 1
