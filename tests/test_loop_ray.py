"""`legorl loop --ray`: every phase of the loop (held-out evaluation, rollout, grading) on a local
Ray cluster of several nodes on this machine (``test_ray_executor``'s cluster fixture, shut down
at the end with no Ray process left), the trained weights shipped to every node's engine after
each step, in the synchronous and the asynchronous driver, and resumed.

Everything real: the driver is the real CLI in a subprocess; each node's worker serves the
embedded engine on the random tiny model behind its own proxy, runs the built-in `mini` agent in
`local` (bubblewrap) sandboxes and grades in fresh ones; the trainer trains on the driver. As in
``test_loop``, the tiny model never solves a task, so the runs keep zero-variance groups and add
an entropy bonus for the trainer to have a gradient (save → ship → reload → new version).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_ray_executor import LocalCluster, _cli, cluster  # noqa: F401 (the fixture)

from legorl.records import Trajectory, Turn, read_jsonl

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "fixtures" / "tasks"
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen3"

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def _loop_args(out: Path, address: str, *extra: str) -> list[str]:
    return [
        "--model", str(MODEL), "--tasks-dir", str(TASKS), "--out", str(out),
        "--group-size", "2", "--tasks-per-iteration", "2", "--eval-samples", "1",
        "--eval-limit", "1", "--max-turns", "2", "--max-tokens", "16", "--concurrency", "4",
        "--timeout", "120", "--lr", "1e-3", "--device", "cpu", "--ray", address,
        "drop_zero_variance_groups=false", "entropy_coef=0.01", *extra,
    ]  # fmt: skip


def _nodes(c: LocalCluster) -> set[str]:
    return {c.node_of(n) for n in c.cluster.list_all_nodes()}


def _trajs(folder: Path) -> list[Trajectory]:
    return list(read_jsonl(folder / "trajectories.jsonl", Trajectory))


def _versions(folder: Path) -> set[int]:
    return {
        t.policy_version for p in (folder / "turns").glob("*.jsonl") for t in read_jsonl(p, Turn)
    }


def _state(out: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((out / "state.json").read_text())
    return state


def _no_python3(tmp: Path) -> str:
    """A PATH with everything of /usr/bin but python3: the `mini` agent's interpreter."""
    farm = tmp / "bin"
    farm.mkdir()
    for exe in Path("/usr/bin").iterdir():
        if exe.name != "python3":
            (farm / exe.name).symlink_to(exe)
    return f"{farm}:/usr/local/bin"


def test_the_sync_loop_runs_every_phase_on_the_nodes_and_resumes(
    cluster: LocalCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    nodes = _nodes(cluster)
    assert len(nodes) == 2
    # A third node without the agent's python3: left out by name, the loop goes on elsewhere.
    lacking = cluster.add(PATH=_no_python3(tmp_path))
    try:
        lacking_name = cluster.node_of(lacking)
        out = tmp_path / "run"
        first = _cli("loop", *_loop_args(out, cluster.address, "--iterations", "1"), cwd=tmp_path)
    finally:
        cluster.cluster.remove_node(lacking)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (
        f"on Ray: left out: harness mini is not installed on node {lacking_name} (python3 is not "
        "on PATH); install: install python3 (the built-in agent runs with it)"
    ) in first.stderr
    assert "on Ray: 2 node(s)" in first.stderr
    phases = [out / "eval-before", out / "iter-001", out / "eval-after"]
    ran_on: set[str] = set()
    for folder in phases:
        trajs = _trajs(folder)
        # every run was a Ray worker's (the in-process loop records no node), and graded
        assert trajs and all(t.evidence.get("node") in nodes for t in trajs), folder
        ran_on |= {t.evidence["node"] for t in trajs}
        graded = list(read_jsonl(folder / "graded.jsonl", Trajectory))
        assert len(graded) == len(trajs) and all(g.verdict is not None for g in graded)
        for t in trajs:  # the Turns came back with the result, beside the driver's output
            assert t.turns_ref == [f"turns/{t.trajectory_id}.jsonl"]
            assert list(read_jsonl(folder / t.turns_ref[0], Turn))
    assert ran_on == nodes  # both nodes took runs, the one without python3 none
    state = _state(out)
    it = state["iterations"][0]
    assert it["trained"] and it["runs"] == 4 and state["policy_version"] == 1
    assert it["rollout_trainer_pearson"] is not None and it["rollout_trainer_pearson"] >= 0.99
    assert it["engine_busy_fraction"] is None  # each node's engine is its own: not measured
    # the nodes' engines sampled with version 0, then served the shipped checkpoint as 1
    assert _versions(out / "eval-before") == {0} and _versions(out / "iter-001") == {0}
    assert _versions(out / "eval-after") == {1}

    # Resume with one more iteration: the workers start on the base model, load the last
    # checkpoint (shipped) as version 1, and go on from there.
    again = _cli("loop", *_loop_args(out, cluster.address, "--iterations", "2"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing after iteration 1" in again.stderr
    assert _versions(out / "iter-002") == {1}
    assert _versions(out / "eval-after") == {2}
    assert (out / "eval-at-001" / "trajectories.jsonl").is_file()
    state = _state(out)
    assert state["finished"] == 2 and state["policy_version"] == 2
    assert [i["iteration"] for i in state["iterations"]] == [1, 2]
    assert all(t.evidence.get("node") in nodes for t in _trajs(out / "iter-002"))

    # Finished: it only reports, without a cluster.
    done = _cli("loop", *_loop_args(out, "127.0.0.1:9", "--iterations", "2"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nothing to run" in done.stderr


def test_the_async_loop_runs_on_the_nodes_within_its_staleness(
    cluster: LocalCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    nodes = _nodes(cluster)
    out = tmp_path / "run"
    args = _loop_args(out, cluster.address, "--iterations", "2", "--async", "--max-staleness",
                      "1", "--tasks-per-iteration", "1")  # fmt: skip
    proc = _cli("loop", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on Ray: 2 node(s)" in proc.stderr
    state = _state(out)
    assert state["finished"] == 2 and state["policy_version"] == 2
    for it in state["iterations"]:
        assert it["trained"] and it["samples"] >= 1
        # no trained sample is more than one version behind the trainer
        assert set(it["staleness"]) <= {"0", "1"}, it["staleness"]
    ran_on: set[str] = set()
    for folder in (out / "eval-before", out / "iter-001", out / "iter-002", out / "eval-after"):
        trajs = _trajs(folder)
        assert trajs and all(t.evidence.get("node") in nodes for t in trajs), folder
        ran_on |= {t.evidence["node"] for t in trajs}
    assert ran_on == nodes
    assert _versions(out / "eval-before") == {0} and _versions(out / "eval-after") == {2}


def test_no_cluster_at_the_address_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _cli("loop", *_loop_args(out, "127.0.0.1:9", "--iterations", "1"), cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("legorl loop: error: --ray 127.0.0.1:9: no Ray cluster at"), last
    assert not (out / "eval-before" / "trajectories.jsonl").exists()
