"""`legorl align`: Turn graded trajectories into token-exact training samples.

Not built yet (issue #7): the command says so in one line and exits 2.
"""

from __future__ import annotations

import typer
from legorl.cli._common import not_built

HELP = "Turn graded trajectories into token-exact training samples."


def align(ctx: typer.Context) -> None:
    """Turn graded trajectories into token-exact training samples."""
    not_built("align", issue=7)
