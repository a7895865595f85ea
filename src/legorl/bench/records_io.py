"""Records I/O: write then read Turn records with legorl's orjson reader/writer, beside plain
json doing the same validation, in the same run."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from legorl.records import JsonlWriter, ToolCall, Turn, TurnOutput, from_dict, read_jsonl


def _turn_pool(n: int, seed: int = 0) -> list[Turn]:
    """Turns shaped like an agent session's: a few hundred new prompt tokens, a tool call."""
    rng = random.Random(seed)
    pool = []
    offset = 0
    for i in range(n):
        delta = [rng.randrange(150_000) for _ in range(rng.randint(100, 600))]
        comp = [rng.randrange(150_000) for _ in range(rng.randint(40, 300))]
        pool.append(
            Turn(
                session="bench-session",
                turn=i,
                segment=0,
                api="openai_chat",
                model="tiny-qwen3",
                requested_model="gpt-5",
                prompt_offset=offset,
                prompt_delta=delta,
                completion_ids=comp,
                completion_logprobs=[-rng.expovariate(2.0) for _ in comp],
                finish_reason="tool_calls",
                output=TurnOutput(
                    text="Let me look at the file.",
                    tool_calls=[ToolCall(id=f"call_{i}", name="bash", arguments='{"cmd":"ls"}')],
                ),
                timings={"generate_s": rng.random()},
                time=1764500000.0 + i,
            )
        )
        offset += len(delta) + len(comp)
    return pool


def _write_orjson(path: Path, pool: list[Turn], target: int) -> int:
    written = 0
    with JsonlWriter(path) as writer:
        while written < target:
            for turn in pool:
                writer.write(turn)
            written = path.stat().st_size
    return written


def _write_json(path: Path, pool: list[Turn], target: int) -> int:
    written = 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < target:
            for turn in pool:
                fh.write(json.dumps(turn, default=_fields, separators=(",", ":")) + "\n")
                fh.flush()
            written = fh.tell()
    return written


def _fields(obj: Any) -> dict[str, Any]:
    # What plain json needs to see a dataclass: its fields, shallowly (nested ones recurse here).
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _read_orjson(path: Path) -> int:
    return sum(1 for _ in read_jsonl(path, Turn))


def _read_json(path: Path) -> int:
    # The same validation as legorl's reader, only the decoding differs.
    n = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            from_dict(json.loads(line), Turn)
            n += 1
    return n


def _rate(fn: Callable[[Path], Any], path: Path, nbytes: int) -> float:
    start = time.perf_counter()
    fn(path)
    return nbytes / 1e6 / (time.perf_counter() - start)


def bench_records_io(records_mb: float, passes: int) -> dict[str, Any]:
    """Write then read ``records_mb`` MB of Turn records with orjson (legorl) and plain json."""
    target = int(records_mb * 1e6)
    pool = _turn_pool(64)
    rates: dict[str, list[float]] = {
        k: [] for k in ("orjson_write", "orjson_read", "json_write", "json_read")
    }
    with tempfile.TemporaryDirectory(prefix="legorl-bench-") as tmp:
        path = Path(tmp) / "turns.jsonl"
        for _ in range(passes):
            for name, write, read in (
                ("orjson", _write_orjson, _read_orjson),
                ("json", _write_json, _read_json),
            ):
                path.unlink(missing_ok=True)
                start = time.perf_counter()
                size = write(path, pool, target)
                rates[f"{name}_write"].append(size / 1e6 / (time.perf_counter() - start))
                rates[f"{name}_read"].append(_rate(read, path, size))
                path.unlink()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "bytes_per_pass": size,
        "passes": passes,
        "orjson_write_MBps": round(med["orjson_write"], 1),
        "orjson_read_MBps": round(med["orjson_read"], 1),
        "json_write_MBps": round(med["json_write"], 1),
        "json_read_MBps": round(med["json_read"], 1),
        "write_speedup": round(med["orjson_write"] / med["json_write"], 2),
        "read_speedup": round(med["orjson_read"] / med["json_read"], 2),
        "write_read_speedup": round(
            (1 / med["json_write"] + 1 / med["json_read"])
            / (1 / med["orjson_write"] + 1 / med["orjson_read"]),
            2,
        ),
    }
