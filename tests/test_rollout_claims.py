"""A harness's claim of an environment failure, forged by the agent, through `legorl rollout`
with real harness binaries in Docker sandboxes.

The agent's commands run beside its harness, so the policy could hide a bad episode from
training by making it look like the environment's fault: print what the harness prints when
the proxy fails, into the harness's own output, and kill the harness. Here the `forced` engine
(a fake shipping in the package: scripted completions, log-probs from a real forward pass of
the tiny model) asks each harness's shell tool to do exactly that. Each adapter is fooled (the
claim in the evidence is the forged one), and the rollout still records the episode as
``harness_error``, the policy's outcome, which `legorl verify` grades. The controls are real
proxy errors: the engine fails the harness's next call after the policy's first completion,
and the episode stays ``proxy_error``, masked. Under CI=true a missing Docker daemon fails.
"""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

import pytest
from conftest import sandbox_backend
from test_rollout_harnesses import (
    TASKS,
    TITLE,
    _fix_command,
    _legorl,
    _task,
    rollout_with,
    shell_call,
)

from legorl.protocols import SandboxError
from legorl.records import ENVIRONMENT_FAILURES, Trajectory, read_jsonl
from legorl.rollout import _sandbox_failure

# Run by the agent's shell tool: walk up from itself to the process the sandbox's exec started
# (the limit's ``timeout``, whose parent is outside the sandbox's PID namespace), write the
# forged text into the harness's own stdout, then kill every process between.
_FORGE = """import os, signal, sys
def up(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
chain = [os.getpid()]
while up(chain[-1]) > 0:
    chain.append(up(chain[-1]))
with open(f"/proc/{chain[-2]}/fd/1", "w") as out:
    out.write(sys.argv[1] + "\\n")
for pid in chain[1:-1]:
    os.kill(pid, signal.SIGKILL)
"""

#: What each adapter reads as the proxy failing (its own report of an API error), and what it
#: then claims.
_FORGERIES = {
    "claude-code": (
        '{"type": "result", "subtype": "success", "is_error": true, '
        '"api_error_status": 500, "result": "API Error: 500 upstream failed"}',
        "proxy_error",
    ),
    "opencode": ("Error: APIError: Cannot connect to API: upstream failed", "proxy_error"),
    "qwen-code": (
        '[{"type": "result", "subtype": "error_during_execution", "is_error": true, '
        '"error": {"message": "API Error: Connection error."}}]',
        "proxy_error",
    ),
    "mini": ("", "harness_crash"),  # its exit code is its report: killed, it "crashed"
}


@pytest.mark.parametrize("harness", sorted(_FORGERIES))
def test_a_forged_environment_failure_is_the_policys_outcome(tmp_path: Path, harness: str) -> None:
    text, claim = _FORGERIES[harness]
    forge = f"python3 -c {shlex.quote(_FORGE)} {shlex.quote(text)}"
    script = [
        TITLE,
        {"match": "rectangle_area", "text": shell_call(harness, forge)},
        {"text": "Done.", "repeat": True},  # never asked: the harness is dead by then
    ]
    traj = rollout_with(tmp_path, harness, script)
    assert traj.status == "harness_error", traj.evidence
    assert traj.status not in ENVIRONMENT_FAILURES
    why = traj.evidence["uncorroborated"]
    # The attack fooled the adapter: the claim is the forged one ...
    assert f"the harness reported {claim} after " in why, why
    assert traj.evidence["exit_code"] == 137  # SIGKILL, under the sandbox's `timeout`
    if text:
        assert text in traj.evidence["log_tail"]
    # ... and the episode is graded like any failed attempt, kept for training.
    graded = _legorl(
        "verify", "traj.jsonl", "--tasks", "tasks.jsonl", "--out", "graded.jsonl", cwd=tmp_path
    )
    assert graded.returncode == 0, graded.stderr[-3000:]
    (result,) = read_jsonl(tmp_path / "graded.jsonl", Trajectory)
    assert result.reward == 0.0, result.verdict


@pytest.mark.parametrize("harness", ["mini", "codex"])
def test_an_engine_failure_after_the_policy_acted_stays_a_proxy_error(
    tmp_path: Path, harness: str
) -> None:
    # The first completion applies the fix; nothing is scripted after it, so the forced engine
    # fails the harness's next call (503), as an engine that went down does.
    script = [
        TITLE,
        {"match": "rectangle_area", "text": shell_call(harness, _fix_command(_task()))},
    ]
    traj = rollout_with(tmp_path, harness, script)
    assert traj.status == "proxy_error", traj.evidence
    assert "uncorroborated" not in traj.evidence
    assert "the engine failed the session's last call" in traj.evidence["corroborated"]
    assert "no scripted completion left" in traj.evidence["corroborated"]
    assert traj.patch == _task().patch  # the policy did act: the failure came after


#: What the agent leaves to make the diff of its tree fail (red team, rounds 3, 4 and 8): a
#: folder nobody may read (the local probe runs as the agent's uid), a file whose patch is
#: larger than a patch may be (8 MiB: the diff hands none on, round 8); with what the sandbox
#: says afterwards.
_LONG = "yes ab | head -c 9000000 > /testbed/notes.txt"
UNDIFFABLE = {
    "local-unreadable": ("local", "mkdir /testbed/notes && chmod 000 /testbed/notes", "is up"),
    "local-long": ("local", _LONG, "is up"),
    "docker-long": ("docker", _LONG, "is up"),
    "docker-huge": ("docker", "head -c 230000000 /dev/urandom > /testbed/notes.bin", "is up"),
    # round 9: the daemon refuses to copy a tree with a symlink that leaves it (the stage
    # stopped, the batch's trajectories unwritten)
    "docker-symlink": ("docker", "ln -s ../../../../../etc/passwd /testbed/escape", "is up"),
}


@pytest.mark.parametrize("case", sorted(UNDIFFABLE))
def test_a_tree_the_diff_cannot_take_is_the_policys_outcome(tmp_path: Path, case: str) -> None:
    # That was ``sandbox_error``: verify gave null and training dropped the episode, so a policy
    # could turn any 0 into "no signal". The sandbox is up (its backend says) after the failed diff,
    # or ended while its backend answers: the agent's doing, ``harness_error``, graded 0.
    sandbox, command, said = UNDIFFABLE[case]
    script = [
        TITLE,
        {"match": "rectangle_area", "text": shell_call("mini", command)},
        {"text": "Done.", "repeat": True},
    ]
    traj = rollout_with(tmp_path, "mini", script, sandbox=sandbox)
    assert traj.status == "harness_error", traj.evidence
    assert traj.evidence.get("alive", "").startswith(f"the sandbox {said}"), traj.evidence
    graded = _legorl(
        "verify", "traj.jsonl", "--tasks", "tasks.jsonl", "--out", "graded.jsonl",
        "--sandbox", sandbox, cwd=tmp_path,
    )  # fmt: skip
    assert graded.returncode == 0, graded.stderr[-3000:]
    (result,) = read_jsonl(tmp_path / "graded.jsonl", Trajectory)
    assert result.reward == 0.0, result.verdict


def test_a_sandbox_the_agent_ended_itself_is_its_outcome() -> None:
    # Round 5: as root in its container the agent signals PID 1 (Docker's init, which passes it
    # to the container's main process and exits; the container is removed). Its commands and
    # the diff then fail, which read as ``sandbox_error``, a null. The daemon still answers and
    # the container is gone: what ran in it ended it, ``harness_error``, graded 0.
    backend = sandbox_backend("docker")
    task = _task()

    async def run() -> tuple[bool | None, bool | None, str, dict]:
        box = await backend.start(task, str(TASKS), run_id="legorl-test-ended", proxy_url=None)
        try:
            before = await box.alive()
            await box.exec(["sh", "-c", "kill -TERM 1; sleep 30"], timeout=60)
            evidence: dict = {}
            for _ in range(20):  # the container is removed a moment after its init exits
                if await box.alive() is False:
                    break
                await asyncio.sleep(0.5)
            after = await box.alive()
            return before, after, await _sandbox_failure(box, evidence), evidence
        finally:
            await box.close()

    before, after, status, evidence = asyncio.run(run())
    assert before is True and after is False
    assert status == "harness_error", evidence
    assert evidence["alive"].startswith("the sandbox ended or broke while its backend answers")


def test_a_sandbox_whose_tools_the_agent_replaced_is_its_outcome() -> None:
    # Round 6: root in its container, the agent replaces ``timeout`` (which every command of
    # the backend runs through) with ``false``; a probe that runs ``true`` inside then fails
    # and read as "cannot tell", a null. Liveness is the daemon's view: the container runs.
    backend = sandbox_backend("docker")
    task = _task()

    async def run() -> tuple[int | None, bool | None, str, dict]:
        box = await backend.start(task, str(TASKS), run_id="legorl-test-tools", proxy_url=None)
        try:
            swap = 'cp /bin/false /tmp/f && mv -f /tmp/f "$(command -v timeout)"'
            await box.exec(["sh", "-c", swap], timeout=60)
            try:
                code: int | None = (await box.exec(["true"], timeout=60)).exit_code
            except SandboxError:
                code = None
            evidence: dict = {}
            return code, await box.alive(), await _sandbox_failure(box, evidence), evidence
        finally:
            await box.close()

    code, alive, status, evidence = asyncio.run(run())
    assert code != 0  # the agent's change broke every command the backend runs inside
    assert alive is True
    assert status == "harness_error", evidence


def test_a_local_sandbox_the_agent_broke_itself_is_its_outcome() -> None:
    # Round 6: the host's Python is bound below the agent's writable HOME (or /tmp); the agent
    # replaced the folder holding that mount point with a dangling link, and every later
    # bubblewrap of its sandbox failed to set up. Since round 71 that folder is a tmpfs of each
    # command's own, which no command can move; a sandbox broken that way (the link made here,
    # on the host, as such a command left it) is still the agent's outcome: its folders are
    # there and a bubblewrap with nothing of its own runs, so ``harness_error``.
    backend = sandbox_backend("local")
    task = _task()

    async def run() -> tuple[bool | None, str, bool | None, str, dict]:
        box = await backend.start(task, str(TASKS), run_id="legorl-test-broke", proxy_url=None)
        try:
            flags = box._flags
            bound = [flags[i + 2] for i, f in enumerate(flags[:-2]) if f == "--ro-bind"]
            nested = [p for p in bound if p.startswith(("/root/", "/tmp/"))]
            if not nested:
                pytest.skip("this host's Python is not bound below the sandbox's HOME or /tmp")
            top = "/".join(nested[-1].split("/")[:3])  # /root/.pyenv
            before = await box.alive()
            moved = await box.exec(
                ["sh", "-c", f"mv {top} {top}-moved && ln -s /nonexistent {top}"]
            )
            alive = await box.alive()
            held = f"{moved.exit_code}: {moved.output.strip()}"
            mount, name = top.rsplit("/", 1)
            host = box.root / {"/root": "home", "/tmp": "tmp"}[mount] / name
            host.rmdir()  # the empty mount point bwrap made
            host.symlink_to("/nonexistent")
            evidence: dict = {}
            return before, held, alive, await _sandbox_failure(box, evidence), evidence
        finally:
            await box.close()

    before, held, alive, status, evidence = asyncio.run(run())
    assert before is True and alive is True and "busy" in held, held
    assert status == "harness_error", evidence
