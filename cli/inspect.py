"""`legorl inspect`: Live trajectory, sample and metric viewer (Textual).

Not built yet (issue #9): the command says so in one line and exits 2.
"""

from __future__ import annotations

import typer
from legorl.cli._common import not_built

HELP = "Live trajectory, sample and metric viewer (Textual)."


def inspect(ctx: typer.Context) -> None:
    """Live trajectory, sample and metric viewer (Textual)."""
    not_built("inspect", issue=9)
