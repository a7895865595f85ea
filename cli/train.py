"""`legorl train`: One or more policy-gradient steps (GSPO, GRPO, Dr.GRPO) on samples.

Not built yet (issue #8): the command says so in one line and exits 2.
"""

from __future__ import annotations

import typer
from legorl.cli._common import not_built

HELP = "One or more policy-gradient steps (GSPO, GRPO, Dr.GRPO) on samples."


def train(ctx: typer.Context) -> None:
    """One or more policy-gradient steps (GSPO, GRPO, Dr.GRPO) on samples."""
    not_built("train", issue=8)
