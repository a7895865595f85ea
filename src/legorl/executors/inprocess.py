"""The in-process executor: a loop's rollout and grading work run in this process, through the
loop's own proxy core (each work's sessions write their Turns to its folder) and sandbox
backends of this machine, built from the work's names and kept for the executor's life.

    executor = InProcessExecutor(core, server_url)
    async for traj in executor.rollout(RolloutWork(runs=runs, harness="mini", ...)):
        ...
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

from legorl.protocols import GradeWork, RolloutWork, SandboxBackend
from legorl.records import Trajectory, Turn


class InProcessExecutor:
    """``legorl.protocols.Executor`` in this process, over ``core`` (a ``ProxyCore``) served at
    ``url``."""

    name: ClassVar[str] = "inprocess"

    def __init__(self, core: Any, url: str) -> None:
        self.core = core
        self.url = url
        self._backends: dict[str, SandboxBackend] = {}

    def backend(self, sandbox: str, options: dict[str, Any]) -> SandboxBackend:
        """The sandbox backend ``sandbox`` with ``options``, built once."""
        from legorl.sandbox import make_backend

        key = f"{sandbox} {json.dumps(options, sort_keys=True, default=str)}"
        if key not in self._backends:
            self._backends[key] = make_backend(sandbox, **options)
        return self._backends[key]

    async def prepare(self, sandbox: str, sandbox_options: dict[str, Any], tasks: list) -> None:
        import asyncio

        backend = self.backend(sandbox, sandbox_options)
        ensure = getattr(backend, "ensure_images", None)
        if ensure is not None:  # a prebuilt image that cannot be had stops it now
            await asyncio.to_thread(ensure, tasks)

    async def rollout(self, work: RolloutWork) -> AsyncIterator[Trajectory]:
        from legorl.harnesses import make_harness
        from legorl.rollout import RunContext, core_endpoint, rollout

        folder = Path(work.folder)
        ctx = RunContext(
            harness=make_harness(work.harness, **work.harness_options),
            backend=self.backend(work.sandbox, work.sandbox_options),
            proxy=core_endpoint(self.core, self.url, folder / "turns", adapter=work.adapter),
            model=work.model,
            tasks_dir=Path(work.tasks_dir),
            timeout=work.timeout,
            run_id=work.run_id,
            refs_relative_to=folder,
        )
        async for traj in rollout(work.runs, ctx, concurrency=work.concurrency):
            yield traj

    async def grade(self, work: GradeWork) -> AsyncIterator[Trajectory]:
        from legorl.verify import verify

        folder = Path(work.folder)

        def load(traj: Trajectory) -> list[Turn]:
            return load_turns(traj, folder)

        async for graded in verify(
            work.trajectories,
            {t.instance_id: t for t in work.tasks},
            backend=self.backend(work.sandbox, work.sandbox_options),
            tasks_dir=work.tasks_dir,
            run_id=work.run_id,
            load_turns=load,
            concurrency=work.concurrency,
        ):
            yield graded

    async def load_weights(self, path: str) -> int:
        """The loop's engine, behind its proxy, swapped to the checkpoint at ``path``."""
        version: int = await self.core.load_weights(path)
        return version

    async def close(self) -> None:
        self._backends.clear()


def load_turns(traj: Trajectory, folder: Path) -> list[Turn]:
    """A trajectory's Turns for the hack scans; a run without readable Turns is still graded."""
    from legorl.align import AlignError, turns_of
    from legorl.records import RecordError

    try:
        return list(turns_of(traj, folder))
    except (AlignError, RecordError):
        return []
