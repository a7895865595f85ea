"""Session crossing, attacked from inside real sandboxes on both backends.

Two runs, two sessions, two sandboxes, each reaching the in-process proxy through its own
relay, as the rollout starts them. From inside sandbox A a stdlib script sends raw HTTP
requests (so nothing rewrites the request target) for every way of naming the other run's
session: its bare id, its id with a mangled or guessed secret, its id as the API key, path
tricks, the absolute form, and the admin routes. Each must fail with the answer a session that
does not exist gets, and leave the victim's Turn file and session state as they were; A's own
calls still work. The control turns isolation off (the proxy's test-only switch) and the same
attempts then cross into the victim, so the checks here can see a crossing.

The engine is the `forced` fake that ships in the package (scripted completions scored by a
real forward pass of the tiny model).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from conftest import run_task
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    ROOT,
    TASKS_DIR,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    run,
    run_id,
    task,
)

from legorl.engines import make_engine
from legorl.rollout import inprocess_proxy

MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
A, B, W = "legorl-toy__geometry-1.0", "legorl-toy__geometry-1.1", "legorl-toy__geometry-1.2"
GHOST = "legorl-toy__geometry-1.9"  # never opened: what "does not exist" answers
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]

# Sends each request as raw bytes to the relay's port inside the sandbox; prints the answers.
PROBE = r"""
import json, socket, sys
port = int(sys.argv[1])
out = []
for a in json.load(sys.stdin):
    body = json.dumps(a["body"]).encode() if a["body"] is not None else b""
    head = f"{a['method']} {a['target']} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in a["headers"].items())
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(head.encode() + b"\r\n" + body)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    status, _, rest = data.partition(b"\r\n")
    out.append({
        "name": a["name"],
        "status": int(status.split()[1]) if status else 0,
        "body": rest.partition(b"\r\n\r\n")[2].decode("latin-1"),
    })
print(json.dumps(out))
"""

# Looks for a string (read from stdin, so that it is not on its own command line) in what a
# process could leak through: command lines and environments, and the writable folders.
LEAK = r"""
import glob, os, sys
needle = sys.stdin.read().encode()
found = []
for path in glob.glob("/proc/[0-9]*/cmdline") + glob.glob("/proc/[0-9]*/environ"):
    try:
        if needle in open(path, "rb").read():
            found.append(path)
    except OSError:
        pass
for top in ("/tmp", "/run", "/root"):
    for folder, _, files in os.walk(top):
        for name in files:
            try:
                if needle in open(os.path.join(folder, name), "rb").read():
                    found.append(os.path.join(folder, name))
            except OSError:
                pass
print(" ".join(found))
"""


def _chat(system: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 8,
        "stream": False,
        "tools": TOOLS,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
    }


def _messages(system: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 8,
        "system": system,
        "tools": [{"name": "bash", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "hi"}],
    }


def attempts(victim: str, mangled: str, own: str, port: int) -> list[dict[str, Any]]:
    """Every way tried of reaching ``victim``'s session from a client whose route is ``own``
    (``mangled``: a secret that is not the victim's). Each entry: name, method, target,
    headers, body, and the statuses a refusal may have."""
    chat, msgs = "/v1/chat/completions", "/v1/messages"
    evil = _chat("ATTACKER")

    def one(name: str, target: str, ok: set[int], **kw: Any) -> dict[str, Any]:
        return {
            "name": name,
            "method": kw.get("method", "POST"),
            "target": target,
            "headers": kw.get("headers", {}),
            "body": kw.get("body", evil),
            "refused": sorted(ok),
        }

    pct = "".join(f"%{b:02X}" for b in victim.encode())
    # A target the HTTP layer may refuse as malformed (400) or route to nothing (404).
    trick = {400, 404}
    return [
        one("bare id", f"/s/{victim}{chat}", {404}),
        one("mangled secret", f"/s/{victim}~{mangled}{chat}", {404}),
        one("guessed secret", f"/s/{victim}~{'0' * 32}{chat}", {404}),
        one("empty secret", f"/s/{victim}~{chat}", {404}),
        one("bearer id", chat, {404}, headers={"Authorization": f"Bearer {victim}"}),
        one(
            "x-api-key id",
            msgs,
            {404},
            headers={"x-api-key": victim, "anthropic-version": "2023-06-01"},
            body=_messages("ATTACKER"),
        ),
        one("dot segments", f"{own}/../{victim}{chat}", trick),
        one("dot segments to /s", f"{own}/../../s/{victim}{chat}", trick),
        one("double slash", f"//s/{victim}{chat}", trick),
        one("nested route", f"{own}/s/{victim}{chat}", trick),
        one("percent-encoded id", f"/s/{pct}{chat}", trick),
        one("percent-encoded s", f"/%73/{victim}{chat}", trick),
        one("percent-encoded tilde", f"/s/{victim}%7E{mangled}{chat}", trick),
        one("percent-encoded slash", f"{own}%2F..%2F{victim}{chat}", trick),
        one("absolute form", f"http://127.0.0.1:{port}/s/{victim}{chat}", trick),
        one("admin open", "/admin/sessions", {401}, body={"id": f"{victim}-2"}),
        one("admin close", f"/admin/sessions/{victim}", {401}, method="DELETE", body=None),
        one(
            "admin with own route",
            "/admin/sessions",
            {401},
            headers={"Authorization": f"Bearer {own.rsplit('~', 1)[1]}"},
            body={"id": f"{victim}-2"},
        ),
        one("admin under own route", f"{own}/admin/sessions", {401}, body={"id": "x.3"}),
    ]


async def _probe(box: Any, tries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    port = urlsplit(box.proxy_url).port
    await box.write_file("/tmp/probe.py", PROBE.encode())
    r = await box.exec(["python3", "/tmp/probe.py", str(port)], stdin=json.dumps(tries).encode())
    assert r.exit_code == 0, r.output
    return {a["name"]: a for a in json.loads(r.output.strip().splitlines()[-1])}


def _state(core: Any, turns: Path, sid: str) -> tuple[Any, ...]:
    """Everything a crossing could change about a session: its Turn file, its main system
    prompt, its segments and its auxiliary sub-sessions."""
    session = core.sessions.get(sid)
    path = turns / f"{sid}.jsonl"
    main = session.main if session else None
    return (
        path.read_bytes() if path.exists() else None,
        None if main is None else (main.system, main.turns, main.segments),
        None if session is None else sorted(session.aux),
    )


def test_a_sandbox_reaches_only_its_own_session(backend: Any, tmp_path: Path) -> None:
    t = task()
    turns = tmp_path / "turns"

    async def go() -> None:
        engine = make_engine(
            "forced", model_path=str(MODEL), script=[{"text": "ok", "repeat": True}]
        )
        try:
            async with inprocess_proxy(MODEL, engine, turns) as (endpoint, core):
                await crossings(endpoint, core)
        finally:
            await engine.close()

    async def crossings(endpoint: Any, core: Any) -> None:
        access = {sid: await endpoint.open_session(sid, None) for sid in (A, B)}
        boxes = {
            sid: await backend.start(t, str(TASKS_DIR), run_id=run_id(), proxy_url=access[sid].url)
            for sid in (A, B)
        }
        box_a, box_b = boxes[A], boxes[B]
        try:
            own = urlsplit(box_a.proxy_url).path
            port = urlsplit(box_a.proxy_url).port
            secret_b = access[B].secret
            mangled = secret_b[:-1] + ("0" if secret_b[-1] != "0" else "1")
            assert own == f"/s/{A}~{access[A].secret}"  # the route is the capability

            # B's harness is running, its route on its command line; A finds it nowhere.
            for box in (box_a, box_b):
                await box.write_file("/tmp/leak.py", LEAK.encode())
            sleeper = asyncio.ensure_future(
                box_b.exec(
                    [
                        "python3",
                        "-c",
                        "import os, time\nopen('/tmp/up', 'w').close()\n"
                        "while not os.path.exists('/tmp/stop'): time.sleep(0.05)",
                        f"{box_b.proxy_url}/v1",
                    ],
                    timeout=120,
                )
            )
            for _ in range(600):
                if (await box_b.exec(["test", "-e", "/tmp/up"])).exit_code == 0:
                    break
                await asyncio.sleep(0.1)
            needle = secret_b.encode()
            leak = await box_a.exec(["python3", "/tmp/leak.py"], stdin=needle, timeout=120)
            await box_b.write_file("/tmp/stop", b"")
            await sleeper
            assert leak.exit_code == 0 and leak.output.strip() == "", leak.output
            # the probe does find it beside a process that has it on its command line
            seen = await box_b.exec(
                [
                    "sh",
                    "-c",
                    'python3 -c "import time; time.sleep(60)" "$0" & python3 /tmp/leak.py; kill $!',
                    box_b.proxy_url,
                ],
                stdin=needle,
                timeout=120,
            )
            assert "/cmdline" in seen.output, seen.output

            before = _state(core, turns, B)
            tries = attempts(B, mangled, own, port)
            twins = attempts(GHOST, mangled, own, port)
            got = await _probe(box_a, tries)
            ghost = await _probe(box_a, twins)
            for attempt in tries:
                name = attempt["name"]
                answer = got[name]
                assert answer["status"] in attempt["refused"], (name, answer)
                # the answer says nothing about whether B exists
                twin = ghost[name]
                assert (answer["status"], answer["body"]) == (
                    twin["status"],
                    twin["body"].replace(GHOST, B),
                ), name
            assert json.loads(got["bare id"]["body"])["error"]["type"] == "not_found_error"
            assert json.loads(got["x-api-key id"]["body"])["type"] == "error"  # Anthropic's
            assert _state(core, turns, B) == before, "a request from A changed B's session"
            assert sorted(core.sessions) == [A, B]  # nothing was opened or created
            assert not (turns / f"{GHOST}.jsonl").exists()

            # A's own calls work, even carrying B's id as the API key, and go to A.
            mine = await _probe(
                box_a,
                [
                    {
                        "name": "own",
                        "method": "POST",
                        "target": f"{own}/v1/chat/completions",
                        "headers": {"Authorization": f"Bearer {B}", "x-api-key": B},
                        "body": _chat("A-SYSTEM"),
                    }
                ],
            )
            assert mine["own"]["status"] == 200, mine
            assert _state(core, turns, B) == before
            assert core.sessions[A].main.system == "A-SYSTEM"
            # B's own harness binds B's main system prompt, untouched by A's attempts.
            theirs = await _probe(
                box_b,
                [
                    {
                        "name": "own",
                        "method": "POST",
                        "target": f"{urlsplit(box_b.proxy_url).path}/v1/chat/completions",
                        "headers": {},
                        "body": _chat("B-SYSTEM"),
                    }
                ],
            )
            assert theirs["own"]["status"] == 200
            assert core.sessions[B].main.system == "B-SYSTEM"
            assert [len(_lines(turns, s)) for s in (A, B)] == [1, 1]

            # Control: with isolation off, the same attempts from A cross into a fresh
            # session W: they are answered, write W's Turns and bind W's system prompt.
            core.config.isolate_sessions = False
            try:
                await endpoint.open_session(W, None)
                crossed = await _probe(box_a, attempts(W, mangled, own, port))
            finally:
                core.config.isolate_sessions = True
            won = {n for n, a in crossed.items() if a["status"] == 200}
            assert {"bare id", "bearer id", "x-api-key id"} <= won, crossed
            assert len(_lines(turns, W)) == len(won)
            assert core.sessions[W].main.system == "ATTACKER"
        finally:
            for box in boxes.values():
                await box.close()
            for sid in (A, B, W):
                await endpoint.close_session(sid)

    run(go())


def _lines(turns: Path, sid: str) -> list[bytes]:
    path = turns / f"{sid}.jsonl"
    return path.read_bytes().splitlines() if path.exists() else []


CALL_OWN_ROUTE = r"""
import json, os, urllib.request
body = {"model": "m", "max_tokens": 8, "tools": [{"type": "function", "function": {"name":
        "bash", "parameters": {"type": "object"}}}], "messages": [{"role": "user", "content": "hi"}]}
req = urllib.request.Request(os.environ["LEGORL_PROXY_URL"] + "/v1/chat/completions",
                             data=json.dumps(body).encode(), headers={"content-type": "application/json"})
print("status", urllib.request.urlopen(req, timeout=120).status)
"""


def test_the_secret_stays_out_of_what_the_run_records(local_backend: Any, tmp_path: Path) -> None:
    """A harness that prints its own route (as harnesses do in errors): the Trajectory has the
    secret redacted, the Turn file never had it, and it is dead once the run ends."""
    from legorl.harnesses.testing import ScriptedHarness
    from legorl.records import to_json

    harness = ScriptedHarness(
        command=f"echo \"base url: $LEGORL_PROXY_URL\"; python3 -c '{CALL_OWN_ROUTE}'"
    )
    handed: list[Any] = []

    async def go() -> Any:
        engine = make_engine(
            "forced", model_path=str(MODEL), script=[{"text": "ok", "repeat": True}]
        )
        try:
            async with inprocess_proxy(MODEL, engine, tmp_path / "turns") as (endpoint, core):

                async def open_and_note(sid: str, system: str | None) -> Any:
                    handed.append(await opener(sid, system))
                    return handed[-1]

                opener = endpoint.open_session
                endpoint.open_session = open_and_note
                traj = await run_task(
                    task(),
                    harness,
                    local_backend,
                    endpoint,
                    refs=tmp_path,
                    tasks_dir=TASKS_DIR,
                    run_id=run_id(),
                )
                assert sorted(core.sessions) == []  # closed with the run
                return traj
        finally:
            await engine.close()

    traj = run(go())
    (access,) = handed
    assert traj.status == "ok", traj.evidence
    assert "status 200" in traj.evidence["log_tail"]
    assert f"/s/{traj.trajectory_id}~…" in traj.evidence["log_tail"]  # printed, then redacted
    assert access.secret.encode() not in to_json(traj)
    turns = (tmp_path / traj.turns_ref[0]).read_text()
    assert turns.count("\n") == 1 and access.secret not in turns
