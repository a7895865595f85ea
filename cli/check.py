"""`legorl check`: Preflight validation of a run: model, template, engine, proxy, sandbox, tasks.

Not built yet (issue #9): the command says so in one line and exits 2.
"""

from __future__ import annotations

import typer
from legorl.cli._common import not_built

HELP = "Preflight validation of a run: model, template, engine, proxy, sandbox, tasks."


def check(ctx: typer.Context) -> None:
    """Preflight validation of a run: model, template, engine, proxy, sandbox, tasks."""
    not_built("check", issue=9)
