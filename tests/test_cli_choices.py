"""The CLI says what exists: every harness, engine, sandbox and algorithm a command's help lists
is read from its registry, so a newly registered one shows up without editing the help."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import get_args

import pytest

from legorl.engines import ENGINES
from legorl.harnesses import HARNESSES
from legorl.loop_config import LOOP_ENGINES
from legorl.sandbox import SANDBOXES
from legorl.train.config import Algorithm


def _help(*command: str) -> str:
    text = subprocess.run(
        [sys.executable, "-m", "legorl.cli.main", *command, "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"},
        timeout=120,
    ).stdout
    # rich draws the options in a box: keep the words, drop the frame and the wrapping
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", text))


def _listed(names: list[str]) -> str:
    return " | ".join(names)


@pytest.mark.parametrize(
    ("command", "flag", "names"),
    [
        (("rollout",), "--harness", list(HARNESSES)),
        (("rollout",), "--engine", list(ENGINES)),
        (("rollout",), "--sandbox", list(SANDBOXES)),
        (("verify",), "--sandbox", list(SANDBOXES)),
        (("check",), "--engine", list(ENGINES)),
        (("check",), "--sandbox", list(SANDBOXES)),
        (("proxy", "serve"), "--engine", list(ENGINES)),
        (("loop",), "--sandbox", list(SANDBOXES)),
        (("loop",), "--algorithm", list(get_args(Algorithm))),
        (("loop",), "--engine", list(LOOP_ENGINES)),
    ],
)
def test_each_choice_in_the_help_comes_from_its_registry(
    command: tuple[str, ...], flag: str, names: list[str]
) -> None:
    text = _help(*command)
    assert flag in text, text[:2000]
    assert _listed(names) in text, (flag, names, text[:3000])


def test_every_registered_harness_is_listed() -> None:
    # the eight harnesses, not the four the help once named by hand
    assert len(list(HARNESSES)) >= 8
    text = _help("rollout")
    for name in HARNESSES:
        assert name in text, name


def test_the_loop_engines_are_registered_engines() -> None:
    assert set(LOOP_ENGINES) <= set(ENGINES)
