"""legorl's command line: the table of contents. Each subcommand lives in its own module.

legorl rollout … | legorl verify | legorl align | legorl train …
legorl loop …   # all of them, K times, with the weights reloaded in between
"""

from __future__ import annotations

from typing import Annotated

import typer

from legorl import __version__

from . import align, cat, check, inspect, loop, proxy, rollout, sandbox, train, verify

app = typer.Typer(
    name="legorl",
    help="Harness-native reinforcement learning for coding agents. "
    "Stages read and write JSONL records, so they pipe: "
    "legorl rollout … | legorl verify | legorl align | legorl train …",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.add_typer(proxy.app, name="proxy", help=proxy.HELP)
app.add_typer(sandbox.app, name="sandbox", help=sandbox.HELP)
app.command("rollout", help=rollout.HELP)(rollout.rollout)
app.command("verify", help=verify.HELP)(verify.verify)
app.command("align", help=align.HELP)(align.align)
app.command("train", help=train.HELP)(train.train)
app.command("loop", help=loop.HELP)(loop.loop)
app.command("inspect", help=inspect.HELP)(inspect.inspect)
app.command("check", help=check.HELP)(check.check)
app.command("cat")(cat.cat)


def _version(value: bool) -> None:
    if value:
        print(f"legorl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Harness-native reinforcement learning for coding agents."""


if __name__ == "__main__":
    app()
