"""Reads from a sandbox are bounded and streamed, on both backends: a 1 GiB sparse file read
with a limit costs the host a few MiB (tracemalloc's peak), and a file over the limit raises
``FileTooLarge`` naming it; the control reads a smaller file with no limit and its cost grows
with the file, which is what the bound prevents."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import pytest
from sandbox_fixtures import (  # noqa: F401  (fixtures are found by name)
    TASKS_DIR,
    fixture_backend,
    fixture_docker_backend,
    fixture_local_backend,
    run_id,
    task,
)

from legorl.protocols import READ_LIMIT, FileTooLarge

MIB = 1 << 20


async def _peak(coro: Any) -> tuple[Any, int]:
    """The coroutine's result (or exception) and the bytes Python held at its peak."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            out: Any = await coro
        except Exception as exc:  # the caller checks which
            out = exc
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("grading", [False, True])
def test_reads_are_bounded_and_streamed(backend: Any, grading: bool) -> None:
    # A grading sandbox's /tmp and /testbed are tmpfs mounts, which Docker's archive API does
    # not see: its reads take another path, bounded the same.
    async def go() -> None:
        box = await backend.start(task(), str(TASKS_DIR), run_id=run_id(), grading=grading)
        try:
            made = await box.exec(
                "truncate -s 1G /tmp/sparse.log && head -c 48M /dev/zero > /tmp/mid.bin && "
                "head -c 3000000 /dev/urandom > /tmp/exact.bin",
                timeout=120,
            )
            assert made.exit_code == 0, made.output
            got, peak = await _peak(box.read_file("/tmp/sparse.log", limit=MIB))
            assert isinstance(got, FileTooLarge), got
            assert got.path == "/tmp/sparse.log" and got.limit == MIB
            assert "/tmp/sparse.log" in str(got) and str(MIB) in str(got)
            assert peak < 8 * MIB, peak  # the bound: the limit plus one 2 MiB chunk, and slack
            # The default limit bounds a caller that names none.
            got, peak = await _peak(box.read_file("/tmp/sparse.log"))
            assert isinstance(got, FileTooLarge) and got.limit == READ_LIMIT
            assert peak < READ_LIMIT + 8 * MIB, peak
            # At the limit exactly, and over several of the daemon's chunks: read whole.
            exact = await box.read_file("/tmp/exact.bin", limit=3_000_000)
            digest = await box.exec("sha256sum /tmp/exact.bin")
            import hashlib

            assert len(exact) == 3_000_000
            assert hashlib.sha256(exact).hexdigest() == digest.output.split()[0]
            with pytest.raises(FileTooLarge):
                await box.read_file("/tmp/exact.bin", limit=2_999_999)
            # Control: unbounded, the host holds the whole file (so the measure can fail).
            whole, peak = await _peak(box.read_file("/tmp/mid.bin", limit=None))
            assert isinstance(whole, bytes) and len(whole) == 48 * MIB
            assert peak >= 48 * MIB
            del whole
        finally:
            await box.close()

    asyncio.run(go())


def test_closing_a_sandbox_of_many_files_lets_the_loop_run(local_backend: Any) -> None:
    # Round 3: the local backend removed a sandbox's tree on the event loop, so a tree of
    # 500,000 files held every other grading for seconds. The marker coroutine, started
    # beside close(), runs before close() ends only when close() leaves the loop.
    async def go() -> list[str]:
        box = await local_backend.start(task(), str(TASKS_DIR), run_id=run_id())
        made = await box.exec(
            "mkdir -p .cache-d && cd .cache-d && seq 20000 | xargs touch", timeout=120
        )
        assert made.exit_code == 0, made.output
        order: list[str] = []

        async def closing() -> None:
            await box.close()
            order.append("closed")

        async def marker() -> None:
            order.append("marker")

        await asyncio.gather(closing(), marker())
        return order

    assert asyncio.run(go()) == ["marker", "closed"]


def test_capped_stream_stops_past_its_cap() -> None:
    """The Docker reader's view of the daemon's chunks: a stream that outgrows the size the
    daemon stated is cut at the cap, not read to its end."""
    from legorl.sandbox.common import ChunkReader, StreamOver

    pulled = []

    def chunks() -> Any:
        for i in range(1000):
            pulled.append(i)
            yield b"x" * MIB

    reader = ChunkReader(chunks(), 3 * MIB)
    with pytest.raises(StreamOver):
        reader.read()
    assert len(pulled) == 4  # the fourth chunk crosses the cap; nothing after it is pulled
    assert ChunkReader(iter([b"ab", b"cd"]), 4).read() == b"abcd"
