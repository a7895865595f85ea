"""Benchmarks for `nox -s bench`: each measures legorl beside a baseline in the same run.

    python -m legorl.bench --out bench.json [--only records_io|proxy|vllm|…] [--records-mb 1024]
    python -m legorl.bench --quick --out bench.json   # every section, small: a smoke test

Every benchmark returns plain numbers and the ratios the issues set targets on; the report is
one JSON file. Wall-clock figures on these shared machines are noisy, so each rate is the median
of several passes and the targets are ratios, never absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from legorl import __version__


def _records_io(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.records_io import bench_records_io

    return bench_records_io(args.records_mb, args.passes)


def _proxy(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.proxy import bench_proxy

    return bench_proxy(quick=args.quick)


def _proxy_codex(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.proxy_codex import bench_proxy_codex

    return bench_proxy_codex(quick=args.quick)


def _align(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.align import bench_align

    return bench_align(quick=args.quick)


def _sandbox(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.sandbox import bench_sandbox

    return bench_sandbox(quick=args.quick)


def _train(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.train import bench_train

    return bench_train(quick=args.quick)


def _ray(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.ray import bench_ray

    return bench_ray(quick=args.quick)


def _rollout(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.rollout import bench_rollout

    return bench_rollout(quick=args.quick)


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.verify import bench_verify

    return bench_verify(quick=args.quick)


def _decode(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.decode import bench_decode

    return bench_decode(quick=args.quick)


def _tasks(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.tasks import bench_tasks

    return bench_tasks(quick=args.quick)


def _vllm(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.vllm import bench_vllm

    return bench_vllm(quick=args.quick)


def _vllm_failover(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.vllm_failover import bench_vllm_failover

    return bench_vllm_failover(quick=args.quick)


def _lora(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.lora import bench_lora

    return bench_lora(quick=args.quick)


def _realsuite(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.realsuite import bench_realsuite

    return bench_realsuite(quick=args.quick)


def _harness_shapes(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.harness_shapes import bench_harness_shapes

    return bench_harness_shapes(quick=args.quick)


def _loop_async(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.loop_async import bench_loop_async

    return bench_loop_async(quick=args.quick)


def _routing(args: argparse.Namespace) -> dict[str, Any]:
    from legorl.bench.routing import bench_routing

    return bench_routing(quick=args.quick)


BENCHMARKS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "records_io": _records_io,
    "proxy": _proxy,
    "proxy_codex": _proxy_codex,
    "harness_shapes": _harness_shapes,
    "align": _align,
    "sandbox": _sandbox,
    "rollout": _rollout,
    "ray": _ray,
    "verify": _verify,
    "tasks": _tasks,
    "decode": _decode,
    "realsuite": _realsuite,
    "train": _train,
    "routing": _routing,
    "vllm": _vllm,
    "async": _loop_async,
    "vllm_failover": _vllm_failover,
    "lora": _lora,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m legorl.bench", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench.json"))
    parser.add_argument("--only", action="append", choices=sorted(BENCHMARKS))
    parser.add_argument(
        "--records-mb",
        type=float,
        default=None,
        help="MB of Turn records written and read per pass (default 1 GB; 16 MB with --quick)",
    )
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke test")
    args = parser.parse_args(argv)
    if args.records_mb is None:
        args.records_mb = 16.0 if args.quick else 1024.0
    report: dict[str, Any] = {
        "legorl": __version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name in args.only or sorted(BENCHMARKS):
        print(f"bench: {name} …", file=sys.stderr, flush=True)
        report[name] = BENCHMARKS[name](args)
        print(f"bench: {name}: {json.dumps(report[name])}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"bench: wrote {args.out}", file=sys.stderr)
    return 0
