"""nox sessions: the README's two commands and the checks around them.

nox -s tests    # the suite on CPU (all but the fixtures' gold checks)
nox -s lint     # ruff + mypy on src/legorl and cli/
nox -s bench    # writes bench.json: legorl beside its baselines, as ratios
nox -s fixtures # the gold checks over whole task suites
nox -s demo     # the main job: `legorl loop` on the embedded default (CPU, local sandboxes)
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

PYTHON = "3.11"


def _install(session: nox.Session) -> None:
    session.install("-e", ".[dev]")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite on CPU (all but the `fixtures` gold checks), on two workers
    (``LEGORL_TEST_WORKERS`` to change; a module's tests share one, see tests/conftest.py).
    Arguments go to pytest, on one worker."""
    _install(session)
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    workers = os.environ.get("LEGORL_TEST_WORKERS", "2")
    session.run(
        "pytest", "-n", workers, "--dist", "loadgroup", "--durations", "40", "-m", "not fixtures"
    )


@nox.session(python=PYTHON)
def fixtures(session: nox.Session) -> None:
    """The gold checks over whole task suites (every toy task fails before and passes after its
    gold patch, the generators reproduce the committed files, the real suite's gold patches pass
    through verify on both backends): run them when a suite or its generator changes."""
    _install(session)
    workers = os.environ.get("LEGORL_TEST_WORKERS", "2")
    session.run("pytest", "-n", workers, "--dist", "loadgroup", "-m", "fixtures", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff on everything; mypy on the library and cli/ (installed, so their imports are typed)."""
    _install(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")


@nox.session(python=PYTHON)
def redteam(session: nox.Session) -> None:
    """Every known reward hack through real rollout + verify in Docker; writes build/redteam.md."""
    _install(session)
    session.run("pytest", "tests/verify/test_redteam.py", "-v", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks measured side by side in one run; the report goes to bench.json."""
    _install(session)
    session.run("python", "-m", "legorl.bench", "--out", "bench.json", *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """`legorl loop` with its defaults: rollout → verify → align → train, weights reloaded into
    the proxy each iteration, held-out evaluation before and after; embedded engine on CPU, local
    sandboxes. Re-running continues runs/demo; extra arguments go to `legorl loop`."""
    _install(session)
    session.run("legorl", "loop", "--out", "runs/demo", *session.posargs)
