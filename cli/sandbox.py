"""`legorl sandbox`: Build, list and clean the layered sandbox image cache.

Not built yet (issue #4): the command says so in one line and exits 2.
"""

from __future__ import annotations

import typer
from legorl.cli._common import not_built

HELP = "Build, list and clean the layered sandbox image cache."


def sandbox(ctx: typer.Context) -> None:
    """Build, list and clean the layered sandbox image cache."""
    not_built("sandbox", issue=4)
