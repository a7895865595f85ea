"""Where a loop's rollout and grading work runs: executors behind ``legorl.protocols.Executor``.

The work is plain data (``RolloutWork``, ``GradeWork``: records and config), so an executor may
run it here (``InProcessExecutor``: the loop's own proxy and a sandbox backend of this machine)
or send it to other machines, each of which builds its own sandbox backend and proxy front
(``legorl.executors.ray.RayExecutor``: one worker per node of a Ray cluster; ``ray`` is imported
only there, when ``--ray`` asks for it).
"""

from __future__ import annotations

from legorl.executors.inprocess import InProcessExecutor

__all__ = ["InProcessExecutor"]
