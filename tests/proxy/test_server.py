"""`legorl.proxy.server` process settings for serving."""

from __future__ import annotations

import subprocess
import sys

from legorl.proxy import server


def test_serving_processes_tune_the_garbage_collector() -> None:
    # In a fresh interpreter: the library leaves the collector alone, the serving helper tunes it.
    code = (
        "import gc; from legorl.proxy import server; before = gc.get_threshold()[0]; "
        "server.tune_gc_for_serving(); "
        "print(before, gc.get_threshold()[0], gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, frozen = out.stdout.split()
    assert int(before) == 700  # CPython's default, untouched by importing the proxy
    assert int(after) == server.GC_YOUNG_THRESHOLD and frozen == "True"
