"""`legorl verify`: Grade trajectories' patches in a fresh sandbox; adds reward, verdict and hack flags.

Not built yet (issue #6): the command says so in one line and exits 2.
"""

from __future__ import annotations

import typer
from legorl.cli._common import not_built

HELP = "Grade trajectories' patches in a fresh sandbox; adds reward, verdict and hack flags."


def verify(ctx: typer.Context) -> None:
    """Grade trajectories' patches in a fresh sandbox; adds reward, verdict and hack flags."""
    not_built("verify", issue=6)
