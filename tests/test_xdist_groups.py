"""`nox -s tests` runs the suite on pytest-xdist workers with `--dist loadgroup`: a module's tests
share one worker (tests/conftest.py), so its module fixtures are built once and its last tests
can read what its first ones left, and the modules that start real vLLM share one group. These
tests check that the scheduler really keeps a group together with the pytest and xdist installed
here, and that each module of this suite is in exactly one group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Modules whose tests are independent and deliberately spread over the workers, each test in a
#: group of its own (one bench section each).
SPREAD = {"tests/bench/test_bench_quick.py"}

_RECORD = """
import os
import pytest

@pytest.mark.parametrize("i", range(6), ids=IDS)
def test_one(i):
    with open(os.environ["WHERE"], "a") as f:
        f.write(f"{__name__} {os.environ['PYTEST_XDIST_WORKER']} {os.getpid()}\\n")
"""
# ids like the red team's hack names: paths, brackets, parentheses, an '@'
_IDS = [
    "tests/conftest.py hook",
    "a [bracketed] word",
    "exits 1 (pytest)",
    "user@example.com",
    "x::y",
    "plain",
]


def test_loadgroup_keeps_each_module_and_shared_group_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    header = f"IDS = {_IDS!r}\n"
    shared = 'pytestmark = pytest.mark.xdist_group("shared")\n'
    for name, extra in [("a", ""), ("b", ""), ("c", ""), ("s1", shared), ("s2", shared)]:
        (tmp_path / f"test_{name}.py").write_text(header + _RECORD + extra)
    where = tmp_path / "where.txt"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2"]
        + ["--dist", "loadgroup", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "WHERE": str(where)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in where.read_text().splitlines():
        module, worker, pid = line.split()
        workers["shared" if module in ("test_s1", "test_s2") else module].add(f"{worker}/{pid}")
    assert sum(1 for _ in where.read_text().splitlines()) == 30
    assert {g: len(w) for g, w in workers.items()} == dict.fromkeys(
        ["test_a", "test_b", "test_c", "shared"], 1
    ), dict(workers)
    # both workers took part: the groups are spread, not serialised
    assert len(set().union(*workers.values())) == 2, dict(workers)


_PROBE = """
import json, os, pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    groups = {}
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        groups[item.nodeid] = sorted(names)
    with open(os.environ["GROUPS_OUT"], "w") as f:
        json.dump(groups, f)
"""


def test_each_module_of_the_suite_is_in_one_group(tmp_path: Path) -> None:
    (tmp_path / "groups_probe.py").write_text(_PROBE)
    out = tmp_path / "groups.json"
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "groups_probe"]
        + ["-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        env={**os.environ, "GROUPS_OUT": str(out), "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    groups: dict[str, list[str]] = json.loads(out.read_text())
    assert len(groups) > 500  # the whole suite was collected
    by_module: dict[str, set[str]] = defaultdict(set)
    for nodeid, names in groups.items():
        assert len(names) == 1, (nodeid, names)  # two marks would join into a third group
        by_module[nodeid.split("::")[0]].add(names[0])
    split = {m: sorted(g) for m, g in by_module.items() if len(g) > 1 and m not in SPREAD}
    assert not split, split
    assert set(by_module["tests/engines/test_vllm_harnesses.py"]) == {"vllm"}
    assert set(by_module["tests/verify/test_redteam.py"]) == {"tests/verify/test_redteam.py"}
