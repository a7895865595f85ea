"""``legorl loop --engine vllm`` end to end on a REAL vLLM server that the loop launches: two
iterations of rollout (the ``mini`` agent in bubblewrap sandboxes) → verify → align → train, the
new weights pushed into the running server after each (reload, then a prefix-cache reset), and
held-out evaluations before and after. Under CI=true a missing vLLM or bubblewrap fails.

As in tests/test_loop.py, the mechanics runs keep zero-variance groups and add an entropy bonus,
so that every iteration trains and so changes the weights the next one must be served from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_vllm_real import ROOT, legorl, vllm_python
from test_vllm_real_rollout import _need_bwrap

from legorl.records import Turn, read_jsonl

# Real vLLM servers: one at a time on the host, with the other vLLM modules (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("vllm")

MODEL = ROOT / "fixtures" / "models" / "tiny-agent"
TASKS = ROOT / "fixtures" / "tasks"


def _versions(folder: Path) -> set[int]:
    return {
        t.policy_version for p in (folder / "turns").glob("*.jsonl") for t in read_jsonl(p, Turn)
    }


def _check(graded: Path, model: Path, out: Path) -> dict:
    """``legorl align --check`` of ``graded`` against ``model``: its fidelity figures."""
    done = legorl(
        "align", str(graded), "--out", str(out / "samples.jsonl"), "--check",
        "--model", str(model), "--min-corr", "0", "--summary", str(out / "align.json"),
        "--device", "cpu",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "align.json").read_text())["check"]


def test_the_loop_runs_on_real_vllm_and_syncs_the_weights_every_iteration(tmp_path: Path) -> None:
    _need_bwrap()
    run = tmp_path / "run"
    done = legorl(
        "loop", "--engine", "vllm", "--engine-opt", f"python={vllm_python()}",
        "--engine-opt", "max_model_len=4096", "--model", str(MODEL), "--tasks-dir", str(TASKS),
        "--out", str(run), "--iterations", "2", "--group-size", "2",
        "--tasks-per-iteration", "1", "--eval-samples", "1", "--eval-limit", "1",
        "--max-turns", "2", "--max-tokens", "24", "--concurrency", "2", "--timeout", "300",
        "--sandbox", "local", "drop_zero_variance_groups=false", "entropy_coef=0.01",
        timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "vllm-server.log").is_file()  # the loop launched its own server
    state = json.loads((run / "state.json").read_text())
    assert state["finished"] == 2 and state["policy_version"] == 2
    assert [i["trained"] for i in state["iterations"]] == [True, True]
    assert [e["policy_version"] for e in state["evals"]] == [0, 2]
    # Turns sampled between two syncs carry the version in between.
    assert _versions(run / "eval-before") == {0}
    assert _versions(run / "iter-001") == {0}
    assert _versions(run / "iter-002") == {1}
    assert _versions(run / "eval-after") == {2}
    # Iteration 2 was sampled from iteration 1's checkpoint: its trainer agrees with vLLM.
    assert state["iterations"][1]["rollout_trainer_pearson"] >= 0.999
    # The held-out prompts are the ones evaluated first, so vLLM had their prefixes cached under
    # the starting weights: after two syncs the records match the last checkpoint, not those.
    last = run / state["checkpoint"]
    with_last = _check(run / "eval-after" / "graded.jsonl", last, tmp_path / "last")
    with_start = _check(run / "eval-after" / "graded.jsonl", MODEL, tmp_path / "start")
    assert with_last["pearson"] >= 0.999 and with_last["max_abs_diff"] < 1e-3, with_last
    assert with_start["max_abs_diff"] > 10 * with_last["max_abs_diff"], with_start


def _session_pids(sid: int) -> list[tuple[int, str]]:
    """Live (not zombie) processes of session ``sid``, with their command lines."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append((int(stat.parent.name), cmdline.decode(errors="replace")))
    return found


def test_the_async_loop_ends_by_itself_when_its_vllm_server_dies(tmp_path: Path) -> None:
    """The engine dies (its vLLM server and workers are SIGKILLed) while the trainer waits for
    its first batch. The loop must not wait for the dead engine: the episodes that start after
    the death end as proxy_error at once, the first step with a sample (batch 1 finished one
    before the death) trains, its weight sync finds no live server, and the loop process exits
    by itself with that reason, leaving no process behind. The test's timeout only guards it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from legorl.records import ENVIRONMENT_FAILURES, Trajectory

    _need_bwrap()
    run = tmp_path / "run"
    args = [
        "loop", "--engine", "vllm", "--engine-opt", f"python={vllm_python()}",
        "--engine-opt", "max_model_len=4096", "--engine-opt", "relaunch=false",
        "--model", str(MODEL), "--tasks-dir", str(TASKS), "--out", str(run),
        "--iterations", "3", "--group-size", "2", "--tasks-per-iteration", "2",
        "--eval-samples", "1", "--eval-limit", "1", "--max-turns", "2", "--max-tokens", "24",
        "--concurrency", "2", "--timeout", "300", "--sandbox", "local",
        "--async", "--max-staleness", "1", "drop_zero_variance_groups=false", "entropy_coef=0.01",
    ]  # fmt: skip
    stderr = tmp_path / "loop.stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "legorl.cli.main", *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"},
            start_new_session=True,  # its sandboxes and its vLLM server are in its session
        )
    trajectories = run / "iter-001" / "trajectories.jsonl"
    try:
        # the death: once batch 1 has an episode the trainer can use (so step 1 trains)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            done = list(read_jsonl(trajectories, Trajectory)) if trajectories.exists() else []
            if any(t.status not in ENVIRONMENT_FAILURES for t in done):
                break
            time.sleep(0.1)
        assert proc.poll() is None, stderr.read_text()[-3000:]
        guards = [
            pid
            for pid, cmd in _session_pids(proc.pid)
            if cmd.startswith(f"{sys.executable}\0-c\0from legorl.engines.vllm_server")
        ]
        assert len(guards) == 1, _session_pids(proc.pid)
        died = time.time()
        os.killpg(guards[0], signal.SIGKILL)  # the server, its engine core and workers
        rc = proc.wait(timeout=600)  # guards the test only: the loop must end by itself
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = stderr.read_text()
    assert rc == 1, text[-3000:]
    (line,) = [x for x in text.splitlines() if x.startswith("legorl loop: error:")]
    found = re.search(r"iteration (\d): weight sync: .*reached no vLLM replica", line)
    assert found, line
    # it stopped at the first step that trained after the death (a step whose groups all
    # failed has no sample and no sync): the steps before it finished untrained
    state = json.loads((run / "state.json").read_text())
    assert state["finished"] == int(found[1]) - 1 < 3 and state["policy_version"] == 0
    assert not any(it["trained"] for it in state["iterations"])
    # the episodes that ran after the death (no Turn of theirs written before it) failed as
    # proxy_error; what was written before it is kept
    late, kept = [], []
    for batch in ("iter-001", "iter-002"):
        path = run / batch / "trajectories.jsonl"
        for t in read_jsonl(path, Trajectory) if path.exists() else []:
            turns = run / batch / "turns" / f"{t.trajectory_id}.jsonl"
            before = turns.exists() and turns.stat().st_mtime <= died
            (kept if before else late).append(t)
    assert late and all(t.status == "proxy_error" for t in late), [
        (t.trajectory_id, t.status, t.evidence) for t in late
    ]
    assert any(t.status not in ENVIRONMENT_FAILURES for t in kept)
    # no sandbox, vLLM process or guard of the loop's session is left
    deadline = time.monotonic() + 30
    while _session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_pids(proc.pid) == []


def test_an_async_lora_loop_on_real_vllm_samples_each_episode_on_one_adapter(
    tmp_path: Path,
) -> None:
    # --async --max-staleness 1 with --lora: the loop starts vLLM with --enable-lora and
    # max_loras covering K + 1 adapter versions, loads each new adapter at runtime, and an
    # episode admitted under an older adapter finishes on it.
    _need_bwrap()
    run = tmp_path / "run"
    done = legorl(
        "loop", "--engine", "vllm", "--engine-opt", f"python={vllm_python()}",
        "--engine-opt", "max_model_len=4096", "--model", str(MODEL), "--tasks-dir", str(TASKS),
        "--out", str(run), "--iterations", "3", "--group-size", "2",
        "--tasks-per-iteration", "1", "--eval-samples", "1", "--eval-limit", "1",
        "--max-turns", "2", "--max-tokens", "24", "--concurrency", "2", "--timeout", "300",
        "--sandbox", "local", "--async", "--max-staleness", "1", "--lora",
        "drop_zero_variance_groups=false", "entropy_coef=0.01", "lora_rank=4",
        timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    server_log = (run / "vllm-server.log").read_text()
    assert "--enable-lora" in server_log and "--max-loras 2" in server_log, server_log[:2000]
    state = json.loads((run / "state.json").read_text())
    assert state["finished"] == 3 and state["policy_version"] == 3
    for it in state["iterations"]:
        assert set(it["staleness"]) <= {"0", "1"}, it["staleness"]
    for k in (1, 2, 3):
        folder = run / f"iter-{k:03d}"
        sessions: dict[str, set[tuple[int, str | None, int | None]]] = {}
        for path in (folder / "turns").glob("*.jsonl"):
            for t in read_jsonl(path, Turn):
                used = (t.policy_version, t.adapter, t.adapter_version)
                sessions.setdefault(path.stem, set()).add(used)
        assert sessions
        for sid, used in sessions.items():
            assert len(used) == 1, (sid, used)  # one adapter version the whole episode
            ((version, adapter, adapter_version),) = used
            # version 0 is the base model; every later one its adapter, by number
            assert (adapter, adapter_version) == (
                (None, None) if version == 0 else ("policy", version)
            )
            # sampled at most K = 1 step behind: step k trains on version k-1 or k-2
            assert version in (k - 1, k - 2), (k, version)
    # On-policy at step 1 (the base model served and trained from): trainer and vLLM agree.
    assert state["iterations"][0]["rollout_trainer_pearson"] >= 0.999
    # Later steps train a step behind, so the trainer's figure measures the policy's move too.
    # What vLLM served is each episode's own adapter version: a forward of that adapter scores
    # its tokens, and the version before it does not.
    checked = set()
    for k in (2, 3):
        for path in sorted((run / f"iter-{k:03d}" / "turns").glob("*.jsonl")):
            turn = next(iter(read_jsonl(path, Turn)))
            v = turn.policy_version
            if v == 0 or v in checked or turn.prompt_offset != 0:
                continue
            checked.add(v)
            own = _gap(run / f"iter-{v:03d}" / "checkpoint", turn)
            before = _gap(MODEL if v == 1 else run / f"iter-{v - 1:03d}" / "checkpoint", turn)
            assert own < 1e-3, (v, own)
            assert before > 10 * own, (v, own, before)
    assert checked, "no episode was sampled through an adapter"


def _gap(policy: Path, turn: Turn) -> float:
    """Mean |served - recomputed| log-prob of ``turn``'s completion under ``policy`` (a model
    folder, or an adapter folder merged onto its base), fp32, T = 1."""
    import torch

    from legorl.train.lora import load_merged

    lm = load_merged(policy, attention="sdpa").float().eval()
    prompt, ids = list(turn.prompt_delta), list(turn.completion_ids)
    with torch.no_grad():
        logits = lm(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    lps = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    return float((lps - torch.tensor(turn.completion_logprobs)).abs().mean())
