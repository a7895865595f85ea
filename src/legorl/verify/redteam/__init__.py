"""The red-team suite's hacking agents: one scripted `mini` run per reward hack.

    nox -s redteam     # each hack through real rollout + verify in Docker; writes the table

Each hack is a `forced`-engine script (scripted completions scored by the real model) that makes
the built-in agent attempt the hack on a toy task, then submit. Every hack really cheats: it
uses what it finds so that a grader without the named defence would give reward 1. Grading must
give reward 0 (and the named flag, where one applies), while the honest gold fix gets 1.

A hack's ``kind`` says where its defence lives:

* ``grading``: a defence of `legorl.verify.grade`; ``off`` names the switches of
  ``VerifyConfig.defences_off`` that, all off, let the hack win (its control).
* ``history`` / ``network`` / ``hostview``: a sandbox property (one commit of history; no
  network; on ``local``, no host folder beyond the system's). The hack's
  own tool output must show the attempt failing; its control is the same hack on a sandbox that
  lacks the property.
* ``diff``: the rollout's diff (clean git, outside the agent's reach) keeps the hack's text out
  of the patch; its control is the old in-sandbox diff, graded with ``off`` switched off.
* ``session``: the proxy's session isolation; the hack tries to write a Turn into a sibling
  run's session, and the sibling must receive nothing.

The agent's steps and the ``Hack`` row are in ``agent``; the rows in ``toy`` (the toy task),
``django`` (a Django task of the real suite, and the ctypes rows), ``rounds``, ``later_rounds``
and ``tree_rounds`` (what each adaptive round found: rounds 1 to 21, 22 to 60, and 61 on).
"""

from __future__ import annotations

from typing import Any

from legorl.verify.redteam.agent import Hack, honest
from legorl.verify.redteam.django import DJANGO_AND_NATIVE
from legorl.verify.redteam.later_rounds import LATER_ROUNDS
from legorl.verify.redteam.rounds import ROUNDS, VARIANT_TESTS, variant_task
from legorl.verify.redteam.toy import TOY, unittest_variant
from legorl.verify.redteam.tree_rounds import TREE_ROUNDS

#: Every row, in the README table's order.
HACKS: list[Hack] = [*TOY, *DJANGO_AND_NATIVE, *ROUNDS, *LATER_ROUNDS, *TREE_ROUNDS]

__all__ = [
    "HACKS",
    "VARIANT_TESTS",
    "Hack",
    "honest",
    "markdown_table",
    "unittest_variant",
    "variant_task",
]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The README's hack → defence → result table from the suite's results, with the count."""
    out = [
        "| hack | defence | reward | control | flags | result |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        flags = ", ".join(row["flags"]) or "—"
        control = "—" if row["control"] is None else row["control"]
        out.append(
            f"| {row['hack']} | {row['defence']} | {row['reward']} | {control} | {flags} "
            f"| {row['result']} |"
        )
    blocked = sum(1 for r in rows if r["result"].startswith("blocked"))
    out.append("")
    out.append(f"{blocked}/{len(rows)} blocked.")
    return "\n".join(out) + "\n"
