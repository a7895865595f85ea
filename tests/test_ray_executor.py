"""`legorl rollout --ray` / `legorl verify --ray` on a local Ray cluster of several nodes on this
machine (``ray.cluster_utils.Cluster``, one module-wide, shut down at the end with no Ray
process left): the work spread over the nodes, Turns shipped back, resume, refusals, and faults
(a node SIGKILLed mid-rollout, the driver killed, a worker that raises).

The agent is the `scripted` harness (a fake shipping in the package: one shell command that
calls its proxy session as a harness would), the engine the `forced` one (a fake shipping in
the package: scripted completions, log-probs from a real forward pass of the tiny model);
sandboxes are the real `local` (bubblewrap) backend. The driver is the real CLI in a
subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from legorl.records import Trajectory, Turn, read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "fixtures" / "tasks" / "train.jsonl"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"
FAULT = "LEGORL_TEST_FAULT"

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

# The scripted agent asks its session twice, then works for a while (SLEEP) and exits 0.
_ASK = (
    "python3 -c 'import json, sys, urllib.request as u\n"
    "for word in sys.argv[2:]:\n"
    '    msgs = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": word}]\n'
    '    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]\n'
    '    body = json.dumps({"model": "m", "messages": msgs, "tools": tools})\n'
    '    req = u.Request(sys.argv[1], body.encode(), {"content-type": "application/json"})\n'
    "    u.urlopen(req, timeout=60).read()\n"
    '\' "$LEGORL_PROXY_URL/v1/chat/completions" fix it && sleep SLEEP'
)


class LocalCluster:
    """A head and worker nodes on this machine, each with two run slots; Ray's files and the
    sandboxes' state in folders of their own."""

    def __init__(self, tmp: Path) -> None:
        from ray.cluster_utils import Cluster

        self.tmp = tmp
        self.state = tmp / "sandbox-state"
        self.state.mkdir()
        (tmp / "npm").mkdir()  # no npm harness on any node: the scripted one needs none
        self.env = {
            "LEGORL_SANDBOX_STATE": str(self.state),
            "LEGORL_NPM_ROOT": str(tmp / "npm"),
            "OMP_NUM_THREADS": "1",
        }
        os.environ["RAY_TMPDIR"] = str(tmp)  # not the machine's /tmp/ray: others run clusters
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                **self._args(),
                "include_dashboard": False,
                "gcs_server_port": 0,
                # a killed node is declared dead in about 2 s, not 30
                "_system_config": {
                    "health_check_period_ms": 500,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        self.address = self.cluster.address

    def _args(self, **env: str) -> dict[str, Any]:
        return {
            "num_cpus": 1,
            "resources": {"legorl_runs": 2},
            "env_vars": {**self.env, **env},
        }

    def add(self, **env: str) -> Any:
        return self.cluster.add_node(**self._args(**env))

    def node_of(self, node: Any) -> str:
        return f"{node.node_ip_address}:{node.node_manager_port}"

    def shutdown(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Any:
    tmp = Path(tempfile.mkdtemp(prefix="/tmp/lr-"))  # short: Ray's socket paths live here
    old = os.environ.get("RAY_TMPDIR")
    c = LocalCluster(tmp)
    try:
        c.add()
        yield c
    finally:
        c.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        left = subprocess.run(["pgrep", "-f", str(tmp)], capture_output=True, text=True)
        assert not left.stdout.strip(), f"Ray processes left: {left.stdout}"


def _args(tmp: Path, *, sleep: float = 0.5, limit: int = 3, g: int = 2, **opts: str) -> list[str]:
    script = tmp / "script.json"
    script.write_text(json.dumps([{"text": "ok", "repeat": True}]))
    args = [
        "--tasks", str(TASKS), "--harness", "legorl.harnesses.testing:ScriptedHarness",
        "--harness-opt", "command=" + _ASK.replace("SLEEP", str(sleep)),
        "--group-size", str(g), "--limit", str(limit), "--engine", "forced",
        "--script", str(script), "--model", str(MODEL), "--sandbox", "local",
        "--out", str(tmp / "traj.jsonl"), "--timeout", "120",
    ]  # fmt: skip
    for key, value in opts.items():
        args += ["--harness-opt", f"{key}={value}"]
    return args


def _cli(cmd: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", cmd, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


def _popen(cmd: str, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "legorl.cli.main", cmd, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ids(path: Path) -> Counter[str]:
    return Counter(t.trajectory_id for t in read_jsonl(path, Trajectory, skip_bad=True))


def _expected(limit: int, g: int) -> set[str]:
    tasks = [json.loads(line)["instance_id"] for line in TASKS.read_text().splitlines()[:limit]]
    return {f"{t}.{k}" for t in tasks for k in range(g)}


def _wait_for(pred: Any, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.1)


def _sandboxes(c: LocalCluster) -> list[dict[str, Any]]:
    out = []
    for folder in c.state.iterdir():
        with_owner = folder / "owner.json"
        if with_owner.is_file():
            out.append({"folder": folder.name, **json.loads(with_owner.read_text())})
    return out


def test_a_rollout_spreads_over_the_nodes_and_ships_turns_back(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    args = [*_args(tmp_path), "--ray", cluster.address]
    first = _cli("rollout", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    trajs = list(read_jsonl(tmp_path / "traj.jsonl", Trajectory))
    assert _ids(tmp_path / "traj.jsonl") == Counter(_expected(3, 2))  # each once
    assert {t.status for t in trajs} == {"ok"}, [t.evidence for t in trajs]
    assert len({t.evidence["node"] for t in trajs}) == 2  # both nodes took runs
    for t in trajs:  # the Turns are here, beside the driver's output, as in-process
        assert t.turns is None and t.turns_ref == [f"traj.jsonl.turns/{t.trajectory_id}.jsonl"]
        turns = list(read_jsonl(tmp_path / t.turns_ref[0], Turn))
        assert len(turns) == 2 and all(turn.completion_ids for turn in turns)
    assert "on Ray: 2 node(s)" in first.stderr

    again = _cli("rollout", *args, cwd=tmp_path)  # resume: everything is done
    assert again.returncode == 0, again.stderr[-2000:]
    assert "6 run(s) already in" in again.stderr
    assert _ids(tmp_path / "traj.jsonl") == Counter(_expected(3, 2))

    # grading on the cluster gives what grading here gives
    here = _cli("verify", str(tmp_path / "traj.jsonl"), "--tasks", str(TASKS), "--sandbox",
                "local", "--out", str(tmp_path / "here.jsonl"), cwd=tmp_path)  # fmt: skip
    assert here.returncode == 0, here.stderr[-2000:]
    there = _cli("verify", str(tmp_path / "traj.jsonl"), "--tasks", str(TASKS), "--sandbox",
                 "local", "--out", str(tmp_path / "there.jsonl"), "--ray", cluster.address,
                 cwd=tmp_path)  # fmt: skip
    assert there.returncode == 0, there.stderr[-2000:]

    def graded(name: str) -> dict[str, Any]:
        return {
            t.trajectory_id: (t.reward, t.verdict.get("resolved") if t.verdict else None)
            for t in read_jsonl(tmp_path / name, Trajectory)
        }

    assert graded("there.jsonl") == graded("here.jsonl") and len(graded("here.jsonl")) == 6


def test_no_cluster_at_the_address_is_one_line(tmp_path: Path) -> None:
    proc = _cli("rollout", *_args(tmp_path), "--ray", "127.0.0.1:9", cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("legorl rollout: error: --ray 127.0.0.1:9: no Ray cluster at")
    assert not (tmp_path / "traj.jsonl").exists()


def test_nodes_that_cannot_take_the_work_refuse_by_name(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    from legorl import __version__
    from legorl.executors.ray import NodeWorker, WorkerSetup

    # a node without bubblewrap: its PATH has everything of /usr/bin but bwrap
    farm = tmp_path / "bin"
    farm.mkdir()
    for exe in Path("/usr/bin").iterdir():
        if exe.name != "bwrap":
            (farm / exe.name).symlink_to(exe)
    no_bwrap = cluster.add(PATH=f"{farm}:/usr/local/bin")
    try:
        name = cluster.node_of(no_bwrap)
        proc = _cli("rollout", *_args(tmp_path, limit=1), "--ray", cluster.address, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"left out: node {name}: sandbox local: bubblewrap (bwrap) is not on PATH" in (
            proc.stderr
        )
        trajs = list(read_jsonl(tmp_path / "traj.jsonl", Trajectory))
        assert len(trajs) == 2 and {t.status for t in trajs} == {"ok"}
        assert name not in {t.evidence["node"] for t in trajs}

        # no node has Claude Code (their npm root is empty): one line, nothing run
        out = tmp_path / "claude.jsonl"
        claude = _cli("rollout", "--tasks", str(TASKS), "--harness", "claude-code", "--limit",
                      "1", "--engine", "forced", "--model", str(MODEL), "--script",
                      str(tmp_path / "script.json"), "--out", str(out), "--ray",
                      cluster.address, cwd=tmp_path)  # fmt: skip
        assert claude.returncode == 1
        last = claude.stderr.strip().splitlines()[-1]
        assert "no node of the cluster can take the work" in last
        assert "harness claude-code is not installed on node" in last
        assert "npm install -g @anthropic-ai/claude-code" in last and not out.exists()

        # a worker whose legorl differs from the driver's refuses by name
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            other = WorkerSetup(version="0.0.0-other")
            worker = ray.remote(NodeWorker).options(num_cpus=0).remote(other, "n1")
            info = ray.get(worker.info.remote(), timeout=120)
            assert info["refused"] == (
                f"node n1 has legorl {__version__}, the driver legorl 0.0.0-other: install the "
                "driver's version there"
            )
            ray.kill(worker)
        finally:
            ray.shutdown()
    finally:
        cluster.cluster.remove_node(no_bwrap)


def test_legorl_help_does_not_import_ray() -> None:
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from legorl.cli.main import app\n"
        "for args in (['--help'], ['rollout', '--help'], ['verify', '--help'], ['loop', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0\n"
        "print('ray' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_a_killed_node_s_runs_run_elsewhere_once_and_gc_clears_its_sandboxes(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    doomed = cluster.add()
    name = cluster.node_of(doomed)
    driver = _popen("rollout", *_args(tmp_path, sleep=12, limit=4), "--ray", cluster.address,
                    cwd=tmp_path)  # fmt: skip
    try:
        # the first wave is on all three nodes (two slots each): then SIGKILL one node (each run
        # sleeps 12 s, so that under load the wave is still whole when its last sandbox starts)
        _wait_for(lambda: len(_sandboxes(cluster)) >= 6)
        cluster.cluster.remove_node(doomed, allow_graceful=False)
        _, err = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 0, err[-3000:]
    assert _ids(tmp_path / "traj.jsonl") == Counter(_expected(4, 2))  # none lost, none twice
    trajs = list(read_jsonl(tmp_path / "traj.jsonl", Trajectory))
    assert {t.status for t in trajs} == {"ok"}
    assert name not in {t.evidence["node"] for t in trajs}
    assert f"re-run after a lost node {name} 2" in err

    left = _sandboxes(cluster)  # the dead node's sandboxes, their owner gone
    assert len(left) == 2, left
    env = {**os.environ, **cluster.env}
    gc = subprocess.run([sys.executable, "-m", "legorl.cli.main", "sandbox", "gc", "--backend",
                         "local"], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert gc.returncode == 0, gc.stderr
    assert _sandboxes(cluster) == [] and not list(cluster.state.iterdir())


def test_a_killed_driver_resumes_with_nothing_lost(cluster: LocalCluster, tmp_path: Path) -> None:
    args = [*_args(tmp_path, sleep=3, limit=4), "--ray", cluster.address]
    driver = _popen("rollout", *args, cwd=tmp_path)
    try:
        _wait_for(lambda: sum(_ids(tmp_path / "traj.jsonl").values()) >= 2 if (
            tmp_path / "traj.jsonl").exists() else False)  # fmt: skip
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=60)
    finally:
        driver.kill()
    before = _ids(tmp_path / "traj.jsonl")
    assert 2 <= sum(before.values()) < 8
    again = _cli("rollout", *args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{sum(before.values())} run(s) already in" in again.stderr
    assert _ids(tmp_path / "traj.jsonl") == Counter(_expected(4, 2))


def test_a_worker_that_raises_keeps_the_others_going(cluster: LocalCluster, tmp_path: Path) -> None:
    faulty = cluster.add(**{FAULT: "1"})
    name = cluster.node_of(faulty)
    try:
        args = [*_args(tmp_path, limit=4, raise_if_env=FAULT), "--ray", cluster.address]
        proc = _cli("rollout", *args, cwd=tmp_path)
    finally:
        cluster.cluster.remove_node(faulty)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _ids(tmp_path / "traj.jsonl") == Counter(_expected(4, 2))
    trajs = list(read_jsonl(tmp_path / "traj.jsonl", Trajectory))
    crashed = [t for t in trajs if t.status == "sandbox_error"]
    assert crashed and all(t.evidence["executor"]["node"] == name for t in crashed)
    assert all("scripted fault" in t.evidence["error"] for t in crashed)
    others = [t for t in trajs if t.status != "sandbox_error"]
    assert others and {t.status for t in others} == {"ok"}
    assert name not in {t.evidence["node"] for t in others}
    assert f"crashes {name} {len(crashed)}" in proc.stderr


def test_the_ray_executor_is_an_executor_for_the_loop_s_work(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    import asyncio

    from legorl import __version__
    from legorl.executors.ray import RayExecutor, WorkerSetup
    from legorl.protocols import Executor, GradeWork, RolloutWork
    from legorl.rollout import EngineSpec, plan_runs
    from legorl.tasks import load_tasks

    _args(tmp_path)  # writes the engine's script
    engine = EngineSpec(
        name="forced",
        weights=MODEL,
        options={"script": str(tmp_path / "script.json")},
        log_dir=tmp_path,
    )
    executor = RayExecutor(
        cluster.address, WorkerSetup(version=__version__, engine=engine, model=str(MODEL))
    )
    assert isinstance(executor, Executor)
    tasks = load_tasks(TASKS)[:2]
    folder = tmp_path / "iter-1"
    work = RolloutWork(
        runs=plan_runs(tasks, 2, None, set(), prefix="it1."),
        harness="legorl.harnesses.testing:ScriptedHarness",
        harness_options={"command": _ASK.replace("SLEEP", "0")},
        model="tiny",
        tasks_dir=str(TASKS.parent),
        folder=str(folder),
        concurrency=4,
        run_id="legorl-ray-work",
    )

    async def go() -> tuple[list[Trajectory], list[Trajectory]]:
        await executor.prepare("local", {}, tasks)
        try:
            trajs = [t async for t in executor.rollout(work)]
            grading = GradeWork(
                trajectories=trajs,
                tasks=tasks,
                tasks_dir=str(TASKS.parent),
                folder=str(folder),
                run_id="legorl-ray-grade",
            )
            return trajs, [g async for g in executor.grade(grading)]
        finally:
            await executor.close()

    try:
        trajs, graded = asyncio.run(go())
    finally:
        ray.shutdown()
    assert sorted(t.trajectory_id for t in trajs) == sorted(r.trajectory_id for r in work.runs)
    assert {t.status for t in trajs} == {"ok"}
    for t in trajs:  # Turns readable from the work's folder, as the Protocol says
        assert t.turns_ref == [f"turns/{t.trajectory_id}.jsonl"]
        assert len(list(read_jsonl(folder / t.turns_ref[0], Turn))) == 2
    assert sorted(g.trajectory_id for g in graded) == sorted(t.trajectory_id for t in trajs)
    assert all(g.verdict is not None for g in graded)
    assert sum(executor.stats.runs.values()) == 8  # 4 rollouts and 4 gradings


def test_an_item_that_takes_down_workers_is_given_up_not_handed_to_every_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Round 55 (reasoned): a worker that dies gives its item back to the queue, and a
    # trajectory whose grading reliably killed its worker would have gone round every node
    # until none was left and the batch stopped. After `LOSSES` lost workers the item is given
    # up (`crashed`); the others still run. No cluster: the workers are stand-ins whose calls
    # finish at once, the poisoned item's by its worker dying.
    import asyncio
    import concurrent.futures

    from ray.exceptions import ActorDiedError

    from legorl.executors import ray as module

    class _Call:
        def __init__(self, item: str) -> None:
            self.item = item

        def future(self) -> concurrent.futures.Future[Any]:
            out: concurrent.futures.Future[Any] = concurrent.futures.Future()
            if self.item == "poison":
                out.set_exception(ActorDiedError())
            else:
                out.set_result(f"done {self.item}")
            return out

    workers = [module._Worker(node=n, node_id=n, slots=1, handle=None) for n in "abcd"]
    stats = module.RayStats()

    async def go() -> list[Any]:
        return [
            result
            async for result in module.schedule(
                None,
                workers,
                ["poison", "x", "y"],
                lambda worker, item: _Call(item),
                lambda item, node, exc: f"gave up {item} on {node}: {exc}",
                stats,
            )
        ]

    results = asyncio.run(go())
    given_up = [r for r in results if r.startswith("gave up")]
    assert sorted(r for r in results if r.startswith("done")) == ["done x", "done y"], results
    assert len(given_up) == 1 and f"{module.LOSSES} workers were lost" in given_up[0], results
    assert sum(stats.lost.values()) == module.LOSSES
    assert sum(w.alive for w in workers) == len(workers) - module.LOSSES
    # The control: with no bound the item takes down every worker, and the batch stops.
    monkeypatch.setattr(module, "LOSSES", 100)
    workers[:] = [module._Worker(node=n, node_id=n, slots=1, handle=None) for n in "abcd"]
    with pytest.raises(module.ExecutorError, match="every node of the cluster is gone"):
        asyncio.run(go())
