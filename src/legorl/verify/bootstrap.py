"""Launches the graded test run so that nothing in the repository can stand in for the runner
(stdlib only; copied into the grading dir outside the repository under a per-run name).

    python -I -B /tmp/legorl-grade/boot-….py pytest SINK [OPTIONS] -- PYTEST_ARGS < key
    python -I -B /tmp/legorl-grade/boot-….py plain SINK [OPTIONS] -- NODEID … < key
    python -I -B /tmp/legorl-grade/boot-….py unittest SINK [OPTIONS] -- SCRIPT ARGS < key
    python -I -B /tmp/legorl-grade/boot-….py unittest SINK [OPTIONS] -- -m MODULE ARGS < key

OPTIONS: ``--no-integrity``, ``--no-twin``, ``--no-audit``, ``--ctypes`` (``plain``: let
``_ctypes`` be imported), ``--xfail-passes`` (an expected failure counts as passed),
``--django=FOLDER:SETTINGS`` (``plain``: Django's test settings
first, `plainrun.django_setup`), ``--watch=FILE`` (a JSON list of the test ids whose
outcomes are recorded one by one; the others are only counted), ``--log=FILE`` (where the run's
own stdout and stderr go).

``-I`` keeps the working and script directories off ``sys.path`` and ignores ``PYTHON*``. The
key is read from stdin before anything else; the record stream goes to a duplicate of the
original stdout (``SINK`` ``fd``) or to a file (``SINK`` a path, the ``stream`` defence off).
In ``pytest`` mode plugin autoload is off, the environment's own plugins are loaded from its
installed distributions' entry points before the repository joins ``sys.path`` (at the end),
and our plugin goes to ``pytest.main`` as an object under a random module name; repository
modules the environment also has (which lose to it) are named in a signed ``shadowed`` record. ``plain`` mode
runs the named tests with the independent runner (`plainrun.py`), never importing ``_pytest``.
``unittest`` mode puts our result recorder in place (`unittest_report.py`), then runs the
runner script (or module) with ``runpy`` as ``__main__``, the repository and the script's
folder last on ``sys.path``; its ``SystemExit`` status goes into the signed finish record.
Before the repository joins ``sys.path`` an audit hook goes in (`plainrun.audit`): the full
one in ``plain`` mode, in ``pytest`` mode one refusing only what pytest never needs. The
signer is only ever a local of `main`, never a global or an attribute of anything importable.
The process exits with the runner's own exit status.
"""

import importlib.util
import json
import os
import secrets
import sys


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _shadowing(repo):
    """Top-level modules of the repository that the environment (stdlib, site-packages) also
    has: with the repository last on sys.path they lose, and a repository has no honest reason
    to carry them."""
    names = []
    for entry in sorted(os.listdir(repo)):
        path = os.path.join(repo, entry)
        if entry.endswith(".py"):
            name = entry[:-3]
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            name = entry
        else:
            continue
        try:
            spec = importlib.util.find_spec(name) if name.isidentifier() else None
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None) or ""
        if spec is not None and not origin.startswith(repo + os.sep):
            names.append(name)
    return names


def _unittest(here, args, emit, guard, repo, plain, options, watch):
    import runpy

    ut = _load(os.path.join(here, "unittest_report.py"), "_legorl_" + secrets.token_hex(8))
    xfail = "passed" if "--xfail-passes" in options else "xfailed"
    integrity = "--no-integrity" not in options
    finish = ut.install(emit, guard, integrity=integrity, watch=watch, xfail=xfail)
    if "--no-audit" not in options:
        plain.audit(pytest=True)
    sys.path.append(repo)
    try:
        if args[0] == "-m":
            sys.argv = ["python -m " + args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.join(repo, args[0])
            sys.argv = [script, *args[1:]]
            sys.path.append(os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = ut.exit_code(exc)
    finish(code)
    return code


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    report = _load(os.path.join(here, "pytest_report.py"), "_legorl_" + secrets.token_hex(8))
    key = report.read_key()
    mode, sink = sys.argv[1], sys.argv[2]
    split = sys.argv.index("--")
    options, args = sys.argv[3:split], sys.argv[split + 1 :]
    # A duplicate of stdout is not inherited by children, and pytest's capture moves fd 1,
    # never this one.
    fd = os.dup(1) if sink == "fd" else os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    emit = report.channel(key, fd)
    del key
    settings = dict(o[2:].split("=", 1) for o in options if "=" in o)
    if "log" in settings:
        # The run's own output goes to a file, so the exec output (capped) holds records only.
        log = os.open(settings["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    repo = os.getcwd()
    plain = _load(os.path.join(here, "plainrun.py"), "_legorl_" + secrets.token_hex(8))
    if mode == "plain":
        ctypes = "--ctypes" in options
        refused = [] if "--no-audit" in options else plain.audit(ctypes=ctypes)
        sys.path.append(repo)
        twin = "--no-twin" not in options
        if "--xfail-passes" in options:
            plain.XFAIL[0] = "passed"
        setup = None
        if "django" in settings:
            setup = lambda: plain.django_setup(repo, settings["django"], args)  # noqa: E731
        sys.exit(plain.run(args, emit, repo=repo, twin=twin, refused=refused, setup=setup))
    watch = None
    if "watch" in settings:
        with open(settings["watch"], encoding="utf-8") as fh:
            watch = frozenset(json.load(fh))
    if mode == "unittest":
        sys.exit(_unittest(here, args, emit, report.Guard, repo, plain, options, watch))
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    from importlib.metadata import entry_points

    plugins = []
    for entry in entry_points(group="pytest11"):
        try:
            plugins.append(entry.load())
        except Exception as exc:  # pytest's own autoload would fail the same way
            print(f"legorl: plugin {entry.name} does not load: {exc}", file=sys.stderr)
    import pytest

    shadowing = _shadowing(repo)
    if shadowing:
        emit({"event": "shadowed", "names": shadowing})
    ours = report.make_plugin(
        emit,
        "_legorl_" + secrets.token_hex(8),
        integrity="--no-integrity" not in options,
        watch=watch,
    )
    if "--no-audit" not in options:
        plain.audit(pytest=True)
    sys.path.append(repo)
    code = pytest.main(args, plugins=[*plugins, ours])
    sys.exit(int(code))


if __name__ == "__main__":
    main()
