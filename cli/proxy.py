"""`legorl proxy`: Token-faithful LLM proxy: serve the engine, or intercept harness traffic.

Not built yet (issue #3): the command says so in one line and exits 2.
"""

from __future__ import annotations

import typer
from legorl.cli._common import not_built

HELP = "Token-faithful LLM proxy: serve the engine, or intercept harness traffic."


def proxy(ctx: typer.Context) -> None:
    """Token-faithful LLM proxy: serve the engine, or intercept harness traffic."""
    not_built("proxy", issue=3)
