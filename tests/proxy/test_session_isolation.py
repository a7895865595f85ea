"""Capability sessions through a real `legorl proxy` server: a session the rollout opens is
reachable only at the route it was handed, never by its bare id, an API key or a guessed
secret, not even after it closed; answers do not tell a session that exists from one that does
not; the admin routes need the admin token; the main system prompt is bound at open or by the
session's own first call; a call still running when its id is reopened records nothing; the
rollout opens sessions on a remote proxy only with its admin token and only if it serves no
open sessions. Each defence has a control with the proxy's test-only switch
``isolate_sessions`` off.

The engine is `forced`, a fake that ships in the package: it replays scripted completions and
computes every log-prob with a real forward pass of the tiny model. (The same crossings from
inside real sandboxes: tests/sandbox/test_session_crossing.py.)
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from proxy_harness import ROOT, running_proxy

from legorl.rollout import SessionOpenError, remote_proxy

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
OK = [{"text": "ok", "repeat": True}]
ADMIN = {"authorization": "Bearer admin-secret"}


def _body(system: str = "agent", **extra: object) -> dict:
    return {
        "model": "m",
        "max_tokens": 8,
        "tools": TOOLS,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        **extra,
    }


def _open(url: str, sid: str, **extra: object) -> str:
    resp = httpx.post(f"{url}/admin/sessions", json={"id": sid, **extra}, headers=ADMIN)
    assert resp.status_code == 200, resp.text
    route = resp.json()["route"]
    assert re.fullmatch(rf"/s/{re.escape(sid)}~[0-9a-f]{{32}}", route)
    return route


def _post(url: str, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def _lines(out: Path, sid: str) -> int:
    path = out / f"{sid}.jsonl"
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def test_a_rollout_session_is_reachable_only_at_its_route(tmp_path: Path) -> None:
    # A proxy a person also uses by hand: open sessions stay, named by path or API key.
    with running_proxy(tmp_path, OK, admin_token="admin-secret") as proxy:
        url, chat = proxy.url, "/v1/chat/completions"
        route = _open(url, "run.0")
        secret = route.rsplit("~", 1)[1]
        assert _post(url, f"{route}{chat}", _body()).status_code == 200
        crossings = {
            "bare id": _post(url, f"/s/run.0{chat}", _body()),
            "bearer": _post(url, chat, _body(), authorization="Bearer run.0"),
            "x-api-key": _post(
                url,
                "/v1/messages",
                {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
                **{"x-api-key": "run.0"},
            ),
            "wrong secret": _post(url, f"/s/run.0~{secret[::-1]}{chat}", _body()),
            "secret as key": _post(url, chat, _body(), authorization=f"Bearer run.0~{secret}"),
        }
        for name, resp in crossings.items():
            assert resp.status_code in (400, 404), (name, resp.text)
        assert crossings["bare id"].json()["error"]["type"] == "not_found_error"
        assert crossings["x-api-key"].json()["type"] == "error"  # in Anthropic's shape
        assert _lines(tmp_path, "run.0") == 1
        # open sessions still work by path and by API key
        assert _post(url, f"/s/mine{chat}", _body()).status_code == 200
        assert _post(url, chat, _body(), authorization="Bearer keyed").status_code == 200
        assert (_lines(tmp_path, "mine"), _lines(tmp_path, "keyed")) == (1, 1)
        # closed, the id never becomes an open session: nothing appends to the run's Turns
        httpx.delete(f"{url}/admin/sessions/run.0", headers=ADMIN).raise_for_status()
        assert _post(url, f"{route}{chat}", _body()).status_code == 404
        assert _post(url, f"/s/run.0{chat}", _body()).status_code == 404
        assert _lines(tmp_path, "run.0") == 1
        # reopened, it has a new secret and the old route is dead
        again = _open(url, "run.0")
        assert again != route
        assert _post(url, f"{route}{chat}", _body()).status_code == 404
        assert _post(url, f"{again}{chat}", _body()).status_code == 200
        # control: with isolation off the bare id and the API key reach it
        proxy.core.config.isolate_sessions = False
        assert _post(url, f"/s/run.0{chat}", _body()).status_code == 200
        assert _post(url, chat, _body(), authorization="Bearer run.0").status_code == 200
        assert _lines(tmp_path, "run.0") == 4


@pytest.mark.parametrize(
    ("api", "path", "body"),
    [
        ("openai_chat", "/v1/chat/completions", _body()),
        ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 8, "messages": []}),
        ("responses", "/v1/responses", {"model": "m", "input": "hi"}),
    ],
)
def test_answers_do_not_tell_whether_a_session_exists(
    tmp_path: Path, api: str, path: str, body: dict
) -> None:
    with running_proxy(tmp_path, OK, admin_token="admin-secret", open_sessions=False) as proxy:
        url = proxy.url
        route = _open(url, "victim.1")
        guess = "0" * 32

        def answers(sid: str) -> list[tuple[int, bytes]]:
            tries = [
                _post(url, f"/s/{sid}{path}", body),
                _post(url, f"/s/{sid}~{guess}{path}", body),
                _post(url, path, body, authorization=f"Bearer {sid}"),
                _post(url, path, body, **{"x-api-key": sid}),
            ]
            return [(r.status_code, r.content.replace(sid.encode(), b"ID")) for r in tries]

        victim, ghost = answers("victim.1"), answers("ghost.1")
        assert victim == ghost
        assert {status for status, _ in victim} == {404}
        for _, content in victim:
            error = orjson.loads(content)
            if api == "anthropic":
                assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
            else:
                assert error["error"]["type"] == "not_found_error"
        assert route not in str(victim)
        assert sorted(proxy.core.sessions) == ["victim.1"]
        assert _lines(tmp_path, "victim.1") == 0


def test_admin_routes_need_the_admin_token(tmp_path: Path) -> None:
    with running_proxy(tmp_path, OK, admin_token="admin-secret") as proxy:
        url = proxy.url
        route = _open(url, "run.0")
        tokens = [None, "Bearer admin-secreT", "Bearer admin-secre", f"Bearer {route}", "run.0"]
        for token in tokens:
            headers = {"authorization": token} if token else {}
            for method, path, body in (
                ("POST", "/admin/sessions", {"id": "run.0"}),
                ("POST", f"{route}/admin/sessions", {"id": "other.0"}),
                ("DELETE", "/admin/sessions/run.0", None),
            ):
                resp = httpx.request(method, f"{url}{path}", json=body, headers=headers)
                assert resp.status_code == 401, (token, path, resp.text)
        assert sorted(proxy.core.sessions) == ["run.0"]
        # the route still works: nobody reopened or closed it
        assert _post(url, f"{route}/v1/chat/completions", _body()).status_code == 200


def test_health_counts_every_session_s_calls_for_the_admin_only(tmp_path: Path) -> None:
    # Round 71: /healthz answers whoever reaches the proxy, a sandbox included, and its counts
    # of sessions, calls and errors moved with every sandbox's calls: one sandbox's 500 bad
    # calls, read by another, a channel between them.
    with running_proxy(tmp_path, OK, admin_token="admin-secret") as proxy:
        url = proxy.url
        route = _open(url, "run.0")
        for path in ("/healthz", f"{route}/healthz"):
            health = httpx.get(f"{url}{path}").json()
            assert health["status"] == "ok" and health["open_sessions"] is not None
            assert not {"sessions", "requests", "errors"} & set(health), health
        admin = {"authorization": "Bearer admin-secret"}
        health = httpx.get(f"{url}/healthz", headers=admin).json()
        assert health["sessions"] == 1 and health["requests"] >= 3, health
    # Round 72: a rollout's in-process proxy has capability sessions and no admin token.
    with running_proxy(tmp_path / "inprocess", OK, open_sessions=False) as proxy:
        health = httpx.get(f"{proxy.url}/healthz").json()
        assert health["open_sessions"] is False and "requests" not in health, health
    # The control: a proxy whose sessions are open (named by the client) counts for anyone.
    with running_proxy(tmp_path / "open", OK) as proxy:
        assert "requests" in httpx.get(f"{proxy.url}/healthz").json()


def test_a_long_prompt_is_encoded_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 72: the proxy encoded a call's prompt on its event loop; one sandbox's 30 MB
    # prompt held it 79 s, during which no other session's call and no sandbox's relayed
    # byte moved (another sandbox's command was recorded as a timeout). It is encoded in a
    # thread of the proxy's own, by the tokenizer's call that lets go of the GIL.
    import threading
    import time

    from legorl.proxy import core

    def answered_first(tmp: Path) -> tuple[int, int]:
        """(long calls answered when a health check sent during the long one is answered,
        the long call's status)."""
        status: list[int] = []
        # A context the prompt passes the bound for (at most 24 bytes a token here) and is
        # over once encoded (about 6 bytes a token): encoded in full, then refused.
        with running_proxy(tmp, OK, engine_max_context=200_000) as proxy:
            url = proxy.url
            big = _body(system="agent " * 400_000)  # about 2.4 MB, 400,000 tokens

            def long_call() -> None:
                status.append(_post(url, "/s/a/v1/chat/completions", big).status_code)

            thread = threading.Thread(target=long_call)
            thread.start()
            time.sleep(0.5)  # the long call is being encoded
            assert httpx.get(f"{url}/healthz", timeout=300).status_code == 200
            errors = proxy.core.stats["errors"]  # the long call's refusal counts as one
            thread.join(300)
        return errors, status[0]

    assert answered_first(tmp_path / "thread") == (0, 400)

    # The control: encoded on the event loop, the health check waits for the long call.
    async def inline(self: Any, fn: Any, *args: Any) -> Any:
        self.tok.limit = self.engine.max_context
        return fn(*args)

    monkeypatch.setattr(core.ProxyCore, "_off_loop", inline)
    assert answered_first(tmp_path / "loop") == (1, 400)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_encoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 73: encoding takes about 170 bytes of memory a byte of text, and a token count
    # encodes as a call does: a few 32 MB bodies held gigabytes of the proxy's memory, which
    # no sandbox's cgroup pays for. No token of a byte-level BPE stands for more bytes than its
    # longest piece, so a text longer than the context times that is refused unread.
    from legorl.proxy.tokens import ChatTokenizer

    encoded: list[int] = []
    real = ChatTokenizer._encode

    def counted(self: ChatTokenizer, text: str) -> list[int]:
        encoded.append(len(text))
        return real(self, text)

    monkeypatch.setattr(ChatTokenizer, "_encode", counted)
    big = "agent " * 20_000  # 120 KB: over 4096 tokens x 24 bytes

    def answers(tmp: Path) -> tuple[httpx.Response, httpx.Response]:
        with running_proxy(tmp, OK, engine_max_context=4096) as proxy:
            url = proxy.url
            chat = _post(url, "/s/a/v1/chat/completions", _body(system=big))
            count = _post(
                url,
                "/s/a/v1/messages/count_tokens",
                {"model": "m", "messages": [{"role": "user", "content": big}]},
            )
        return chat, count

    chat, count = answers(tmp_path / "bound")
    for resp in (chat, count):
        message = resp.json()["error"]["message"]
        assert resp.status_code == 400 and "at least" in message and "4095 maximum" in message
    assert max(encoded, default=0) < 2048, encoded  # nothing long was encoded
    # The control: a tokenizer with no bound encodes the texts in full: the call is refused
    # with its exact count, the count answered.
    monkeypatch.setattr(ChatTokenizer, "max_token_bytes", None)
    chat, count = answers(tmp_path / "unbound")
    assert max(encoded) >= len(big)
    assert chat.status_code == 400 and "at least" not in chat.text, chat.text
    assert count.status_code == 200 and count.json()["input_tokens"] > 4096, count.text


def test_a_session_counts_tokens_one_call_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Round 73: the token-count routes took no lock, and each was encoded in the process's
    # shared thread pool: 16 counts at once from one sandbox held every thread, and other
    # sessions' calls waited 23-31 s. A session's counts now run one at a time, in the
    # proxy's own encoding threads.
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from legorl.proxy.tokens import ChatTokenizer

    now, most = [0], [0]
    guard = threading.Lock()
    real = ChatTokenizer.count

    def slow(self: ChatTokenizer, messages: Any, tools: Any) -> int:
        with guard:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.3)
        with guard:
            now[0] -= 1
        return int(real(self, messages, tools))

    monkeypatch.setattr(ChatTokenizer, "count", slow)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def most_at_once(sessions: list[str]) -> int:
        most[0] = 0
        with (
            running_proxy(tmp_path / "-".join(sessions), OK) as proxy,
            ThreadPoolExecutor(len(sessions)) as pool,
        ):
            paths = [f"/s/{sid}/v1/messages/count_tokens" for sid in sessions]
            codes = list(pool.map(lambda path: _post(proxy.url, path, body).status_code, paths))
        assert codes == [200] * len(sessions), codes
        return most[0]

    assert most_at_once(["a"] * 4) == 1
    # The control: two sessions count at once.
    assert most_at_once(["a", "b", "a", "b"]) == 2


def test_a_call_whose_client_left_is_ended_not_queued(tmp_path: Path) -> None:
    # Round 73: a sandbox sent calls and closed their connections; the server did not notice,
    # and each call stayed queued behind its session's lock, holding its body, until the
    # session got to it. A call whose connection is read to the end now ends.
    import socket

    with running_proxy(tmp_path, OK) as proxy:
        assert proxy.server is not None
        server, engine = proxy.server, proxy.core.engine
        real, started = engine.generate, []

        async def first_waits_for_the_leavers(request: Any) -> Any:
            started.append(request)
            if len(started) == 1:  # the first call holds the session's lock until they left
                for _ in range(300):
                    if server.stats["gone"] >= 3:
                        break
                    await asyncio.sleep(0.1)
            async for chunk in real(request):
                yield chunk

        engine.generate = first_waits_for_the_leavers  # type: ignore[method-assign]
        path = "/s/a/v1/chat/completions"
        payload = orjson.dumps(_body())
        raw = (
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        host, port = proxy.url.removeprefix("http://").split(":")

        def send() -> socket.socket:
            sock = socket.create_connection((host, int(port)), timeout=60)
            sock.sendall(raw)
            return sock

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(_post, proxy.url, path, _body())
            while not started:
                time.sleep(0.01)
            leavers = [send() for _ in range(3)]
            stayer = send()  # the control: a client that waits is answered in its turn
            deadline = time.monotonic() + 60
            while proxy.core.stats["requests"] < 5 and time.monotonic() < deadline:
                time.sleep(0.05)  # every call read and queued behind the first
            for sock in leavers:
                sock.close()
            assert first.result().status_code == 200
        answer = stayer.recv(65536)
        stayer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert server.stats["gone"] == 3
        assert len(started) == 2  # the first call and the stayer's; no leaver's was sampled
        assert len(proxy.turns("a")) == 2


def test_the_main_system_prompt_is_bound_at_open_or_by_the_first_own_call(
    tmp_path: Path,
) -> None:
    with running_proxy(tmp_path, OK, admin_token="admin-secret") as proxy:
        url, chat = proxy.url, "/v1/chat/completions"
        declared = _open(url, "d.0", main_system="DECLARED")
        assert _post(url, f"{declared}{chat}", _body("OTHER")).status_code == 200
        assert _post(url, f"{declared}{chat}", _body("DECLARED")).status_code == 200
        turns = proxy.turns("d.0")
        assert [t.flags.aux for t in turns] == [True, False]
        undeclared = _open(url, "u.0")
        for system in ("FIRST", "SECOND", "FIRST"):
            assert _post(url, f"{undeclared}{chat}", _body(system)).status_code == 200
        assert [t.flags.aux for t in proxy.turns("u.0")] == [False, True, False]
        bad = httpx.post(
            f"{url}/admin/sessions", json={"id": "x.0", "main_system": 5}, headers=ADMIN
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "main_system"
        # control: with isolation off nothing is bound at open; the first caller binds it
        proxy.core.config.isolate_sessions = False
        control = _open(url, "c.0", main_system="DECLARED")
        assert _post(url, f"{control}{chat}", _body("OTHER")).status_code == 200
        assert proxy.core.sessions["c.0"].main.system == "OTHER"


def test_a_call_still_running_when_its_id_is_reopened_records_nothing(tmp_path: Path) -> None:
    # An open session of a name a rollout is about to use (a sandbox could create one on a
    # proxy that serves open sessions): reopening the id as a capability drops it, and its
    # call in flight writes neither a Turn nor state into the new session.
    script = [{"text": "one two three four five six seven eight nine ten"}, *OK]
    with running_proxy(tmp_path, script, engine_chunk_tokens=2) as proxy:
        core = proxy.core
        body = orjson.dumps(_body("SQUATTER", stream=True))

        async def race() -> tuple[str, int]:
            resp = await core.handle("POST", "/s/x.0/v1/chat/completions", "", {}, body)
            chunks = resp.body.__aiter__()
            await chunks.__anext__()
            route = core.open_session("x.0")
            rest = [c async for c in chunks]
            return route, len(rest)

        route, rest = proxy.call(race())
        assert rest > 1  # the old call did go on streaming after the reopen
        assert _lines(tmp_path, "x.0") == 0
        assert core.sessions["x.0"].main is None
        assert _post(proxy.url, f"{route}/v1/chat/completions", _body()).status_code == 200
        assert [t.flags.aux for t in proxy.turns("x.0")] == [False]


def test_error_log_lines_leave_the_secret_out(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with running_proxy(tmp_path, OK, admin_token="admin-secret", log_errors=True) as proxy:
        route = _open(proxy.url, "run.0")
        resp = httpx.post(f"{proxy.url}{route}/v1/chat/completions", content=b"{nope")
        assert resp.status_code == 400
    err = capfd.readouterr().err
    assert "/s/run.0~…/v1/chat/completions" in err
    assert route.rsplit("~", 1)[1] not in err


def test_remote_proxy_opens_sessions_through_the_admin_api(tmp_path: Path) -> None:
    with (
        running_proxy(tmp_path, OK, admin_token="admin-secret") as proxy,
        pytest.raises(SessionOpenError, match="serves open sessions"),
    ):
        remote_proxy(proxy.url, tmp_path, "admin-secret")
    with pytest.raises(SessionOpenError, match="healthz"):
        remote_proxy("http://127.0.0.1:9", tmp_path, "admin-secret")
    with running_proxy(tmp_path, OK, admin_token="admin-secret", open_sessions=False) as proxy:
        endpoint = remote_proxy(proxy.url + "/", tmp_path, "admin-secret")

        async def scenario() -> None:
            access = await endpoint.open_session("r.0", "DECLARED")
            assert access.url.startswith(f"{proxy.url}/s/r.0~") and access.secret in access.url
            assert access.redact(f"GET {access.url}/v1") == f"GET {proxy.url}/s/r.0~…/v1"
            async with httpx.AsyncClient() as client:
                ok = await client.post(f"{access.url}/v1/chat/completions", json=_body())
                assert ok.status_code == 200
                await endpoint.close_session("r.0")
                gone = await client.post(f"{access.url}/v1/chat/completions", json=_body())
                assert gone.status_code == 404
            with pytest.raises(SessionOpenError, match="401"):
                await remote_proxy(proxy.url, tmp_path, "wrong").open_session("r.1", None)
            with pytest.raises(SessionOpenError, match="invalid session id"):
                await endpoint.open_session("bad id", None)

        asyncio.run(scenario())
        assert [t.flags.aux for t in proxy.turns("r.0")] == [True]  # "agent" ≠ DECLARED


def test_rollout_refuses_a_remote_proxy_it_cannot_isolate_runs_on(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LEGORL_ADMIN_TOKEN"}

    def rollout(url: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                *(sys.executable, "-m", "legorl.cli.main", "rollout"),
                *("--tasks", str(ROOT / "fixtures" / "tasks" / "train.jsonl")),
                *("--proxy", url, "--proxy-turns", str(tmp_path), *extra),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    no_token = rollout("http://127.0.0.1:9")
    assert no_token.returncode == 2
    assert "--proxy needs --proxy-token" in no_token.stderr
    with running_proxy(tmp_path, OK, admin_token="admin-secret") as proxy:
        open_proxy = rollout(proxy.url, "--proxy-token", "admin-secret")
    assert open_proxy.returncode == 1
    assert "serves open sessions" in open_proxy.stderr and "--registered-only" in open_proxy.stderr
