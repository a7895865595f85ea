"""Task loading: ``load_tasks`` on SWE-bench-shaped rows (JSONL and Parquet), beside reading the
same file with no mapping or validation, in the same run.

    python -m legorl.bench --only tasks --out bench.json
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows with SWE-bench's columns and about its sizes (issue text, two diffs, test lists)."""
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "value",
        "when",
        "returns",
        "raises",
        "wrong",
        "result",
        "field",
        "model",
        "query",
        "test",
    ]

    def text(n_words: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n_words))

    def diff(lines: int) -> str:
        body = "".join(f"-    {text(6)}\n+    {text(6)}\n" for _ in range(lines))
        return (
            f"diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1,{lines} +1,{lines} @@\n{body}"
        )

    rows = []
    for i in range(n):
        tests = [f"tests/test_m.py::test_{i}_{j}" for j in range(rng.randint(1, 40))]
        rows.append(
            {
                "repo": "owner/project",
                "instance_id": f"owner__project-{i}",
                "base_commit": f"{rng.getrandbits(160):040x}",
                "patch": diff(rng.randint(5, 40)),
                "test_patch": diff(rng.randint(5, 40)),
                "problem_statement": text(rng.randint(100, 400)),
                "hints_text": text(rng.randint(0, 100)),
                "created_at": "2023-05-01T12:00:00Z",
                "version": "3.0",
                "FAIL_TO_PASS": json.dumps(tests[:3]),
                "PASS_TO_PASS": json.dumps(tests[3:]),
                "environment_setup_commit": f"{rng.getrandbits(160):040x}",
                "difficulty": "15 min - 1 hour",
            }
        )
    return rows


def _median_s(fn: Callable[[], object], passes: int) -> float:
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_tasks(quick: bool = False) -> dict[str, Any]:
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    from legorl.tasks import load_tasks

    n, passes = (1_000, 3) if quick else (10_000, 5)
    rows = _rows(n)
    out: dict[str, Any] = {"rows": n, "passes": passes}
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "tasks.jsonl"
        jsonl.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        parquet = Path(tmp) / "tasks.parquet"
        pq.write_table(pa.Table.from_pylist(rows), parquet)
        readers = {
            "jsonl": lambda: [orjson.loads(x) for x in jsonl.read_bytes().splitlines()],
            "parquet": lambda: pq.read_table(parquet).to_pylist(),
        }
        for name, path in (("jsonl", jsonl), ("parquet", parquet)):

            def load(path: Path = path) -> None:
                if len(load_tasks(path, notice=lambda _line: None)) != n:
                    raise AssertionError(f"{path}: not {n} tasks")

            load_s = _median_s(load, passes)
            read_s = _median_s(readers[name], passes)
            out[name] = {
                "file_mb": round(path.stat().st_size / 1e6, 1),
                "load_s": round(load_s, 3),
                "rows_per_s": round(n / load_s),
                "read_only_s": round(read_s, 3),
                "load_over_read": round(load_s / read_s, 2),
            }
    return out
