"""The in-process runner's audit hook (stdlib only; it reaches the grading sandbox through the
bootstrap's stdin). Installed before the repository joins ``sys.path``, it refuses what the
runner never needs and what walks to its signer: object walks (``gc.get_objects`` and
friends), ctypes' audited memory access and foreign calls (loading a library and finding a
symbol are let through: ``import ctypes``, numpy and Django's runner need them), reading
``/proc``, and further audit hooks.

This keeps only the in-process outcome honest against the cheapest tampering; the verdict does
not rest on it. Assertions are judged out of process (`assertions.py`), and the code under
test can reach this process's memory in ways no hook sees (numpy's ``__array_interface__``).
"""

import os
import sys

_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.addaudithook"})
_CTYPES_LOADING = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"})


class Refused(RuntimeError):
    """Raised by the audit hook (a RuntimeError, so a refused ``sys.addaudithook`` is dropped)."""


def audit():
    """Install the hook; returns the list it appends refused event names to."""
    refused = []
    realpath = os.path.realpath

    def allowed(event, args):
        if event.startswith("ctypes."):
            return event in _CTYPES_LOADING
        if event == "open":
            path = args[0]
            if isinstance(path, bytes):
                path = os.fsdecode(path)
            return not (isinstance(path, str) and realpath(path).startswith("/proc/"))
        return event not in _EVENTS

    def hook(event, args):
        if not allowed(event, args):
            refused.append(event)
            raise Refused(f"legorl grading refuses {event}")

    sys.addaudithook(hook)
    return refused
