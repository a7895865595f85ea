"""`legorl rollout`: Run a harness on tasks in sandboxes through the proxy; writes trajectories.

Not built yet (issue #5): the command says so in one line and exits 2.
"""

from __future__ import annotations

import typer
from legorl.cli._common import not_built

HELP = "Run a harness on tasks in sandboxes through the proxy; writes trajectories."


def rollout(ctx: typer.Context) -> None:
    """Run a harness on tasks in sandboxes through the proxy; writes trajectories."""
    not_built("rollout", issue=5)
