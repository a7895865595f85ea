"""Launches the judged test run (stdlib only). It and the grader modules it loads come in
through stdin into memory, never as files the judged code could read or change:

    python -I -B -c "$(LOADER)" pytest -- PYTEST_ARGS        < key line + JSON bundle
    python -I -B -c "$(LOADER)" unittest -- SCRIPT ARGS      < key line + JSON bundle
    python -I -B -c "$(LOADER)" unittest -- -m MODULE ARGS   < key line + JSON bundle
    python -I -B -c "$(LOADER)" script -- bin/test ARGS      < key line + JSON bundle

``LOADER`` (`runner.LOADER`) reads the one-time key and the bundle (``{"modules": {name:
source}, "options": {...}}``) and runs this module's ``main`` with them. Options:
``integrity`` (the runner's guard), ``audit`` (the hook of `audit.py`), ``xfail_passes`` (an
expected failure counts as passed: a control only), ``watch`` (the test ids whose outcomes are
recorded one by one; the others are only counted), ``log`` (where the run's own stdout and
stderr go), ``judge`` (install the operand sender of `operands.py` as ``__legorl__``),
``onward`` (the empty patch's run of a gold record: a failed assertion does not stop its test),
``own_builtins`` (off: the grader's modules look names up in the shared builtins; a control).

``-I`` keeps the working and script directories off ``sys.path`` and ignores ``PYTHON*``. The
record stream goes to a duplicate of the original stdout, signed and chained
(`pytest_report.channel`). In ``pytest`` mode plugin autoload is off, the environment's own
plugins are loaded from its installed distributions' entry points before the repository joins
``sys.path`` (at the end), and our plugin goes to ``pytest.main`` as an object under a random
module name; repository modules the environment also has are named in a ``shadowed`` record.
``unittest`` mode puts our result recorder in place (`unittest_report.py`), then runs the
runner script (or module) with ``runpy`` as ``__main__``, the script's folder first on
``sys.path`` (where Python puts it) and the repository last; its ``SystemExit`` status goes
into the finish record. The process exits with the runner's own exit status.
"""

import importlib.util
import os
import secrets
import sys

#: The builtins the grader's code looks names up in: the loader's private copy, taken before
#: any repository code ran, so code under test that rebinds ``builtins.callable`` (round 26:
#: the sender then skipped the test's callable) or ``builtins.list`` changes nothing here; the
#: integrity guard pins every entry.
_FOUND = globals()["__builtins__"]
_BUILTINS: dict = _FOUND if type(_FOUND) is dict else vars(_FOUND)


def _load(bundle, name):
    """A grader module from the bundle, under a random module name, on the private builtins."""
    module = type(sys)("_legorl_" + secrets.token_hex(8))
    module.__file__ = "<legorl>"
    module.__dict__["__builtins__"] = _BUILTINS
    exec(compile(bundle["modules"][name], f"<legorl {name}>", "exec"), module.__dict__)
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


def _unittest(bundle, args, emit, guard, repo, options, watch):
    import runpy

    ut = _load(bundle, "unittest_report.py")
    xfail = "passed" if options.get("xfail_passes") else "xfailed"
    finish = ut.install(
        emit, guard, integrity=options.get("integrity", True), watch=watch, xfail=xfail
    )
    if options.get("audit", True):
        _load(bundle, "audit.py").audit()
    try:
        if args[0] == "-m":
            sys.path.append(repo)
            sys.argv = ["python -m " + args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.join(repo, args[0])
            sys.argv = [script, *args[1:]]
            # The script's folder first, where Python itself puts it (its files are the task's:
            # the tree judge puts a changed one back, and a new one that would stand in for a
            # module the environment has): a package the patch adds at the
            # repository's root, which an editable install's .pth puts on the path, named like
            # one of the runner's test packages (``utils_tests/``) must not stand in for it
            # (round 31).
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            sys.path.append(repo)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = ut.exit_code(exc)
    finish(code)
    return code


def _script(args, repo):
    """A runner that only prints (sympy's ``bin/test``): run as ``__main__``, nothing of ours
    but the operand sender; its printed output is read by the official parser."""
    import runpy

    script = os.path.join(repo, args[0])
    sys.argv = [script, *args[1:]]
    sys.path.append(repo)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def main(key, bundle):
    global _BUILTINS
    own = bundle.get("options", {}).get("own_builtins", True)
    if not own:
        _BUILTINS = vars(sys.modules["builtins"])  # a control only: the shared builtins
    report = _load(bundle, "pytest_report.py")
    mode = sys.argv[1]
    split = sys.argv.index("--")
    args = sys.argv[split + 1 :]
    options = bundle.get("options", {})
    # A duplicate of stdout is not inherited by children, and pytest's capture moves fd 1,
    # never this one.
    emit = report.channel(key, os.dup(1))
    del key
    log = options.get("log")
    if log:
        # The run's own output goes to a file, so the exec output (capped) holds records only.
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    else:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
    # The channel's closure, for the integrity guard (its encoder and writer were taken
    # when it was made).
    cells = zip(emit.__code__.co_freevars, emit.__closure__ or (), strict=True)
    report.PINS.extend((f"channel.emit.{n}", lambda c=c: c.cell_contents) for n, c in cells)
    if own:
        report.PINS.extend((f"builtins.{n}", lambda n=n: _BUILTINS.get(n)) for n in list(_BUILTINS))
    if options.get("judge", True):
        operands = _load(bundle, "operands.py")
        operands.install(
            emit,
            onward=options.get("onward", False),
            own_call=options.get("own_call", True),
            quiet_sender=options.get("quiet_sender", True),
            c_sender=options.get("c_sender", True),
        )
        spaces, pins = operands.guarded()
        report.SPACES.extend(spaces)
        report.PINS.extend(pins)
    repo = os.getcwd()
    watch = frozenset(options["watch"]) if options.get("watch") is not None else None
    if mode == "unittest":
        sys.exit(_unittest(bundle, args, emit, report.Guard, repo, options, watch))
    if mode == "script":
        sys.exit(_script(args, repo))
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
        integrity=options.get("integrity", True),
        watch=watch,
    )
    if options.get("audit", True):
        _load(bundle, "audit.py").audit()
    sys.path.append(repo)
    code = pytest.main(args, plugins=[*plugins, ours])
    sys.exit(int(code))
