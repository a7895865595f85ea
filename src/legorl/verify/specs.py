"""How a task's tests are run and read: the grader for each task (pytest, unittest-based
runners, printed-output-only runners), its test command, its log parser from the ``swebench``
package (an optional dependency, imported only here and only when a task needs it) and the
spelling of test names.

    legorl verify runs/traj.jsonl --tasks swe-bench-verified.parquet …   (grade() calls resolve)

Where a task's command comes from, first match wins: the task's own ``test_cmd`` (anything but
the default), the row's ``eval_script`` (``swebench`` v5 rows carry it; the command between its
start and end markers), then the repositories legorl knows (Django's ``tests/runtests.py``,
sympy's ``bin/test``) with the test files of the ``test_patch``, as the official harness
builds them. A SWE-bench-family row with none of these is refused with a message naming the
repo, the version and the fields to give.

Kinds: ``pytest`` (our plugin, signed records), ``unittest`` (our result recorder, signed
records; the parser's reading is a cross-check), ``output`` (only printed output exists: the
official parser reads it and the grade is flagged ``output_parsed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Any

from legorl.records import Task

DEFAULT_CMD: str = Task.__dataclass_fields__["test_cmd"].default  # type: ignore[assignment]
DEFAULT_PARSER: str = Task.__dataclass_fields__["log_parser"].default  # type: ignore[assignment]
_START, _END = ">>>>> Start Test Output", ">>>>> End Test Output"
_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
#: Repositories whose test command legorl builds itself: (command head, parser, how test files
#: become arguments). Django's runner takes dotted labels below ``tests/``.
KNOWN: dict[str, tuple[str, str, str]] = {
    "django/django": (
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
        "parse_log_django",
        "django_labels",
    ),
    "sympy/sympy": ("bin/test -C --verbose", "parse_log_sympy", "paths"),
}
#: legorl's own parser names and the ``swebench`` parser each stands for.
ALIASES = {"pytest": "parse_log_pytest", "django": "parse_log_django", "sympy": "parse_log_sympy"}
#: Runner scripts whose printed output is all there is (no in-process hook of ours).
OUTPUT_ONLY = ("bin/test",)
#: The code such a runner prints from, in the repository: runner configuration too (what it
#: prints is all grading reads).
RUNNER_CODE = {"bin/test": ("sympy/testing/runtests.py", "sympy/utilities/runtests.py")}


class SpecError(ValueError):
    """A task whose tests legorl does not know how to run or read."""


@dataclass(frozen=True, slots=True)
class Grader:
    kind: str  # pytest | unittest | output
    command: str  # shell command, run in the repository root
    parser: str | None  # the swebench parser that reads the printed output, if any
    runner: str | None  # the repository path of the runner script (runner configuration)

    def runner_paths(self) -> frozenset[str]:
        """Repository files the tree judge treats as runner configuration."""
        if self.runner is None:
            return frozenset()
        return frozenset({self.runner, *RUNNER_CODE.get(self.runner, ())})


def swebench_parser(name: str) -> Any:
    """The official log parser called ``name``; a clear error when ``swebench`` is missing."""
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY
    except ImportError as exc:
        raise SpecError(
            f"log parser {name!r} comes from the swebench package, which does not import "
            f"({exc}); install it: pip install 'legorl[swebench]'"
        ) from None
    if name not in PARSER_REGISTRY:
        raise SpecError(f"log parser {name!r}: not one of swebench's ({len(PARSER_REGISTRY)})")
    return PARSER_REGISTRY[name]


def test_files(task: Task) -> list[str]:
    """The files the test_patch touches that are not removed, in patch order."""
    out = []
    for _old, new in _DIFF_PATH.findall(task.test_patch):
        if new not in out and new != "/dev/null":
            out.append(new)
    return out


def _django_labels(files: list[str]) -> list[str]:
    labels = []
    for path in files:
        if path.startswith("tests/") and path.endswith(".py"):
            label = path[len("tests/") : -len(".py")].replace("/", ".")
            labels.append(label.removesuffix(".__init__"))
    return labels


def from_eval_script(script: str) -> str | None:
    """The test command between an eval script's start and end markers (one line)."""
    if _START not in script or _END not in script:
        return None
    body = script.split(_START, 1)[1].split(_END, 1)[0]
    lines = [ln.strip() for ln in body.splitlines()[1:] if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith((":", "echo ", "#"))]
    return lines[0] if len(lines) == 1 else None


def _kind(command: str) -> tuple[str, str | None]:
    words = shlex.split(command)
    if words and words[0] in ("python", "python3"):
        words = words[1:]
    if words[:2] == ["-m", "pytest"] or words[:1] == ["pytest"]:
        return "pytest", None
    if words[:2] == ["-m", "unittest"]:
        return "unittest", None
    script = words[0].removeprefix("./") if words else ""
    if script in OUTPUT_ONLY:
        return "output", script
    if script.endswith(".py"):
        return "unittest", script
    return "output", script or None


def resolve(task: Task) -> Grader:
    """The grader for ``task``; a ``SpecError`` naming the repo/version when none is known."""
    parser: str | None = ALIASES.get(task.log_parser, task.log_parser)
    command = task.test_cmd if task.test_cmd != DEFAULT_CMD else None
    script = task.meta.get("eval_script")
    if command is None and isinstance(script, str):
        command = from_eval_script(script)
    if command is None and task.repo in KNOWN:
        head, known_parser, args = KNOWN[task.repo]
        files = test_files(task)
        command = shlex.join(
            [*shlex.split(head), *(_django_labels(files) if args == "django_labels" else files)]
        )
        if task.log_parser == DEFAULT_PARSER:
            parser = known_parser
    if command is None:
        if task.meta.get("task_format"):
            known = ", ".join(sorted(KNOWN))
            raise SpecError(
                f"task {task.instance_id}: repo {task.repo!r} version {task.version!r}: no test "
                f"command is known for it (legorl knows {known}; swebench v5 rows carry "
                "eval_script); give the task a test_cmd and a log_parser, e.g. "
                '"test_cmd": "python -m pytest -rA tests/test_x.py", "log_parser": "pytest"'
            )
        command = task.test_cmd
    kind, runner = _kind(command)
    if kind == "pytest" and task.log_parser == DEFAULT_PARSER:
        parser = None  # the signed stream alone; nothing printed is read
    if kind == "output" and parser in (None, DEFAULT_PARSER, "parse_log_pytest"):
        raise SpecError(
            f"task {task.instance_id}: test_cmd {command!r} is not pytest or a unittest "
            "runner, so only its printed output can be read: give a log_parser that reads "
            "it (one of swebench's, e.g. parse_log_sympy)"
        )
    if parser is not None:
        swebench_parser(parser)
    return Grader(kind=kind, command=command, parser=parser, runner=runner)


#: What one run of an official parser may use: CPU seconds, address space, wall seconds.
PARSE_CPU_S = 20
PARSE_MEMORY = 2 << 30
PARSE_WALL_S = 60.0


async def parse_capped(
    parser: str,
    text: str,
    task: Task,
    *,
    cpu_s: int = PARSE_CPU_S,
    memory: int = PARSE_MEMORY,
    wall_s: float = PARSE_WALL_S,
) -> tuple[dict[str, str], str | None]:
    """The official parser ``parser``'s reading of ``text`` (a test name -> its status word),
    run in a child interpreter with its CPU time (RLIMIT_CPU) and address space (RLIMIT_AS)
    capped, awaited without blocking the event loop: a log that makes a parser backtrack costs
    at most ``cpu_s`` of one core, never another grading's time. On a cap, a crash or a bad
    answer: ``({}, reason)``; otherwise ``(statuses, None)``."""
    swebench_parser(parser)  # a clear SpecError here, not in the child
    request = {
        "parser": parser,
        "text": text,
        "cpu_s": cpu_s,
        "memory": memory,
        "task": {
            "instance_id": task.instance_id,
            "repo": task.repo,
            "version": task.version,
            "FAIL_TO_PASS": task.FAIL_TO_PASS,
            "PASS_TO_PASS": task.PASS_TO_PASS,
        },
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-m",
        "legorl.verify.specs",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), wall_s)
    except TimeoutError:
        return {}, f"log parser {parser}: over {wall_s:g} s of wall time"
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    code = proc.returncode
    if code in (-24, -9, 128 + 24):  # SIGXCPU at the soft limit, SIGKILL at the hard one
        return {}, f"log parser {parser}: over its {cpu_s} s of CPU time"
    if code == 3:
        return {}, f"log parser {parser}: over its {memory >> 20} MiB of memory"
    tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {code}"]
    if code != 0:
        return {}, f"log parser {parser} failed: {tail[0][:300]}"
    try:
        parsed = json.loads(out)
    except ValueError:
        return {}, f"log parser {parser}: an unreadable answer"
    if not isinstance(parsed, dict):
        return {}, f"log parser {parser}: an unreadable answer"
    return {str(k): str(v) for k, v in parsed.items()}, None


def _parse_child() -> int:
    """The child of ``parse_capped``: the request on stdin, the statuses as JSON on stdout;
    exit 3 when the parser ran out of memory."""
    import resource

    request = json.load(sys.stdin)
    parse = swebench_parser(request["parser"])
    from swebench.types import TestSpec

    spec = TestSpec(image="", eval_script_list=[], log_parser=request["parser"], **request["task"])
    # The caps start now: the interpreter and the parser's imports are not the log's doing.
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime) + 1 + int(request["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))
    memory = int(request["memory"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    try:
        result = {str(k): str(v) for k, v in parse(request["text"], spec).items()}
    except MemoryError:
        return 3
    sys.stdout.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_parse_child())
