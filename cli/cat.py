"""`legorl cat`: validate and concatenate record files of any stage.

legorl cat runs/turns/*.jsonl --schema turn --skip-bad --out all-turns.jsonl
"""

from __future__ import annotations

from typing import Annotated

import typer

from legorl.records import SHORT_NAMES, JsonlWriter

from ._common import Inputs, Out, SkipBad, fail, iter_inputs


def cat(
    inputs: Inputs = None,
    out: Out = None,
    schema: Annotated[
        str | None,
        typer.Option(help=f"Accept only this record type: {', '.join(SHORT_NAMES)}."),
    ] = None,
    skip_bad: SkipBad = False,
) -> None:
    """Validate records and write them back out, one per line."""
    expect = None
    if schema is not None:
        expect = SHORT_NAMES.get(schema)
        if expect is None:
            fail(
                "cat",
                f"--schema: unknown record type {schema!r} (one of {', '.join(SHORT_NAMES)})",
                2,
            )
    with JsonlWriter(out) as writer:
        for record in iter_inputs("cat", inputs, expect, skip_bad):
            writer.write(record)
