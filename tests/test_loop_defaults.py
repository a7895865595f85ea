"""`legorl loop`'s default model and tasks: a checkout finds them from any folder; a built wheel,
installed in a fresh venv and run outside the repository, says in one line where to get them.

    python -m pytest tests/test_loop_defaults.py -q
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from conftest import ROOT

AGENT = ROOT / "fixtures" / "models" / "tiny-agent"
TASKS = ROOT / "fixtures" / "tasks-generated"


def test_a_checkout_finds_the_defaults_from_another_folder(tmp_path: Path) -> None:
    code = (
        "from legorl.loop import LoopConfig\n"
        "c = LoopConfig()\n"
        "c.validate()\n"
        "print(c.model)\n"
        "print(c.tasks_dir)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(AGENT), str(TASKS)]


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding only the built wheel; the dependencies are this interpreter's,
    reached through a .pth file (which runs no other .pth, so no editable legorl leaks in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*build, "-w", str(tmp / "dist"), str(ROOT)], check=True, timeout=600)
    (wheel,) = (tmp / "dist").glob("legorl-*.whl")
    env = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    subprocess.run([*install, "--no-deps", str(wheel)], check=True, timeout=600)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = [p for p in sys.path if p.endswith("-packages") and Path(p).is_dir()]
    deps.append(sysconfig.get_paths()["purelib"])
    (Path(site) / "_deps.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(deps)))
    return python


@pytest.mark.slow
def test_the_wheel_says_in_one_line_where_the_defaults_are(
    wheel_python: Path, tmp_path: Path
) -> None:
    where = subprocess.run(
        [str(wheel_python), "-c", "import legorl.loop as m; print(m.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(wheel_python.parents[1]))  # the wheel answers
    legorl = wheel_python.parent / "legorl"
    done = subprocess.run(
        [str(legorl), "loop", "--iterations", "1", "--out", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("legorl loop: error: --model: fixtures/models/tiny-agent: ")
    assert "not in the wheel" in line and "--model DIR and --tasks-dir DIR" in line
    assert not (tmp_path / "out").exists()
    # The control: the same wheel with the checkout's folders given accepts them.
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from legorl.loop import LoopConfig\n"
        "LoopConfig(model=Path(sys.argv[1]), tasks_dir=Path(sys.argv[2])).validate()\n"
    )
    given = subprocess.run(
        [str(wheel_python), "-c", code, str(AGENT), str(TASKS)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert given.returncode == 0, given.stderr
