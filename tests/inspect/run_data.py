"""A small but real run for the viewer's tests: Turns recorded by the real proxy core (forced
engine, tiny model, real tokenizer), Trajectories pointing at them, Samples built from their
tokens, the trainer's recomputed log-probs, Metrics, and the alerts a monitor wrote.

Three trajectories:
* ``traj-0``: ok, reward 1; an aux title call, a tool call, a tool result, then a compaction
  (a second segment); turns by reference (``turns/traj-0.jsonl``); SWE-bench-style verdict.
* ``traj-1``: agent_error, reward 0, hack flag ``test_file_edited``; turns inline.
* ``traj-2``: sandbox_error, no turns.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from legorl.engines import make_engine
from legorl.engines.models import load_model, token_logprobs
from legorl.monitors import Monitor
from legorl.proxy.core import ProxyConfig, ProxyCore
from legorl.records import (
    Metric,
    Sample,
    TokenCounts,
    TrainerLogprobs,
    Trajectory,
    Turn,
    read_jsonl,
    segment_prompts,
    write_jsonl,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
SCREENSHOTS = Path(__file__).resolve().parent / "screenshots"  # SVGs the pilot tests save

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
CALL = (
    "<think>\nLook at the geometry module first.\n</think>\n\n"
    '<tool_call>\n{"name": "bash", "arguments": {"command": "cat geometry.py"}}\n</tool_call>'
)
SCRIPT = [
    {"text": "Fix the area bug", "match": "Write a short title"},
    {"text": CALL, "match": "area of a square"},
    {"text": "The area used the perimeter; I fixed it.", "match": "def area"},
    {"text": "Patched and tested.", "match": "Summary of the work so far"},
    {"text": "I cannot fix this.", "match": "average grade"},
]
PATCH = (
    "diff --git a/geometry.py b/geometry.py\n"
    "--- a/geometry.py\n+++ b/geometry.py\n"
    "@@ -1,2 +1,2 @@\n def area(side):\n-    return 4 * side\n+    return side * side\n"
)


@dataclass
class RunFiles:
    dir: Path
    trajectories: Path
    samples: Path
    metrics: Path
    alerts: Path
    trainer: Path

    def all(self) -> list[Path]:
        return [self.trajectories, self.samples, self.metrics, self.alerts, self.trainer]


async def _record_turns(out: Path) -> None:
    engine = make_engine("forced", model_path=str(MODEL), script=SCRIPT)
    core = ProxyCore(ProxyConfig(model=MODEL, out=out), engine)

    async def chat(session: str, messages: list[dict], tools: bool = True) -> dict:
        body = {"model": "tiny", "messages": messages, "max_tokens": 64, "temperature": 1.0}
        if tools:
            body["tools"] = TOOLS
        resp = await core.handle(
            "POST", f"/s/{session}/v1/chat/completions", "", {}, json.dumps(body).encode()
        )
        assert resp.status == 200, resp.body
        return json.loads(resp.body)  # type: ignore[arg-type]

    user = {"role": "user", "content": "The area of a square is wrong in geometry.py."}
    await chat(
        "traj-0",
        [{"role": "system", "content": "Write a short title."}, user],
        tools=False,
    )
    first = await chat("traj-0", [SYSTEM, user])
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = [
        SYSTEM,
        user,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": "def area(side):\n    return 4 * side",
        },
    ]
    await chat("traj-0", history)
    # The harness compacts its history: a new segment.
    await chat(
        "traj-0", [SYSTEM, {"role": "user", "content": "Summary of the work so far: fixed area."}]
    )
    await chat("traj-1", [SYSTEM, {"role": "user", "content": "The average grade is off by one."}])
    await engine.close()


def _sample(sample_id: str, turns: list[Turn], reward: float, index: int, count: int) -> Sample:
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for turn, prompt in segment_prompts(turns):
        assert prompt[: len(ids)] == ids, "test data: prompts must extend the segment"
        mask += [0] * (len(prompt) - len(ids))
        ids = list(prompt)
        ids += turn.completion_ids
        mask += [1] * len(turn.completion_ids)
        lps += turn.completion_logprobs
    return Sample(
        sample_id=sample_id,
        episode_id=turns[0].session,
        group_id="legorl-toy__geometry-1",
        segment_index=index,
        segment_count=count,
        input_ids=ids,
        loss_mask=mask,
        rollout_logprobs=lps,
        reward=reward,
        advantage=reward - 0.5,
    )


def make_run(root: Path) -> RunFiles:
    turns_dir = root / "turns"
    asyncio.run(_record_turns(turns_dir))
    t0 = list(read_jsonl(turns_dir / "traj-0.jsonl", Turn))
    t1 = list(read_jsonl(turns_dir / "traj-1.jsonl", Turn))
    trajectories = [
        Trajectory(
            trajectory_id="traj-0",
            task_id="legorl-toy__geometry-1",
            group_id="legorl-toy__geometry-1",
            sample_index=0,
            harness="mini",
            status="ok",
            patch=PATCH,
            turns_ref=["turns/traj-0.jsonl"],
            tokens=TokenCounts(
                prompt=sum(t.prompt_len for t in t0),
                completion=sum(len(t.completion_ids) for t in t0),
            ),
            reward=1.0,
            verdict={
                "resolved": True,
                "tests_status": {
                    "FAIL_TO_PASS": {
                        "success": ["tests/test_geometry.py::test_area"],
                        "failure": [],
                    },
                    "PASS_TO_PASS": {
                        "success": ["tests/test_geometry.py::test_perimeter"],
                        "failure": [],
                    },
                },
            },
        ),
        Trajectory(
            trajectory_id="traj-1",
            task_id="legorl-toy__grades-3",
            group_id="legorl-toy__grades-3",
            sample_index=0,
            harness="opencode",
            status="agent_error",
            turns=t1,
            tokens=TokenCounts(prompt=t1[0].prompt_len, completion=len(t1[0].completion_ids)),
            reward=0.0,
            verdict={"resolved": False, "tests": {"tests/test_grades.py::test_average": "FAILED"}},
            hack_flags=["test_file_edited"],
        ),
        Trajectory(
            trajectory_id="traj-2",
            task_id="legorl-toy__bank-2",
            group_id="legorl-toy__bank-2",
            sample_index=0,
            harness="claude-code",
            status="sandbox_error",
            evidence={"error": "sandbox: image build failed"},
        ),
    ]
    files = RunFiles(
        dir=root,
        trajectories=root / "graded.jsonl",
        samples=root / "samples.jsonl",
        metrics=root / "metrics.jsonl",
        alerts=root / "alerts.jsonl",
        trainer=root / "trainer_logprobs.jsonl",
    )
    write_jsonl(files.trajectories, trajectories)
    main0 = [t for t in t0 if not t.flags.aux]
    samples = [
        _sample("traj-0/0", [t for t in main0 if t.segment == 0], 1.0, 0, 2),
        _sample("traj-0/1", [t for t in main0 if t.segment == 1], 1.0, 1, 2),
        _sample("traj-1/0", t1, 0.0, 0, 1),
    ]
    write_jsonl(files.samples, samples)
    model = load_model(MODEL)
    side = []
    for s in samples:
        full = token_logprobs(model, s.input_ids, start=1, temperature=1.0)
        lps = [full[i - 1] for i, m in enumerate(s.loss_mask) if m]
        if s.sample_id == "traj-0/1":  # a trainer that disagrees on a few tokens
            lps = [lp + 3.0 if i % 3 == 0 else lp for i, lp in enumerate(lps)]
        side.append(TrainerLogprobs(sample_id=s.sample_id, logprobs=lps, step=0))
    write_jsonl(files.trainer, side)
    metrics = []
    for step in range(10):
        corr = 0.9995 if step < 7 else 0.95
        metrics += [
            Metric(step=step, name="reward", value=0.2 + 0.05 * step),
            Metric(step=step, name="rollout_trainer_pearson", value=corr),
            Metric(step=step, name="kl", value=0.001 * step),
            Metric(step=step, name="clip_fraction", value=0.02 if step != 5 else 0.4),
        ]
    write_jsonl(files.metrics, metrics)
    monitor = Monitor(alerts_path=files.alerts, stream=None)
    for m in metrics:
        monitor.observe_metric(m)
    return files


# ---- fixtures (imported by the test modules; a conftest.py here would shadow tests/conftest.py)


@pytest.fixture(scope="session")
def built_run(tmp_path_factory: pytest.TempPathFactory) -> RunFiles:
    """The run, built once per test session."""
    return make_run(tmp_path_factory.mktemp("run"))


@pytest.fixture
def run(built_run: RunFiles, tmp_path: Path) -> RunFiles:
    """A private copy of the run, free to append to."""
    dest = tmp_path / "run"
    shutil.copytree(built_run.dir, dest)
    return RunFiles(
        dir=dest,
        trajectories=dest / built_run.trajectories.name,
        samples=dest / built_run.samples.name,
        metrics=dest / built_run.metrics.name,
        alerts=dest / built_run.alerts.name,
        trainer=dest / built_run.trainer.name,
    )
