"""Official prebuilt task images (SWE-bench's ``sweb.eval.x86_64.<id>`` and its relatives): where
their repository and Python live, the scrub that locks their git history down, and what to do
when one is missing.

    legorl rollout --tasks swe-bench-verified.parquet --sandbox docker …   (the docker backend
    builds an instance layer on each task's image with ``scrub_script``)

Layout facts: SWE-bench, SWE-Gym and SWE-smith images keep the repository at ``/testbed`` with
its git history and a conda env ``testbed`` at ``/opt/miniconda3/envs/testbed``; R2E-Gym images
keep the repository at ``/testbed`` and a venv at ``/testbed/.venv`` or ``/root/.venv``. The
first ``ENV_CANDIDATES`` folder with an executable ``bin/python`` leads PATH in the sandbox.

A conda env (one with ``conda-meta/`` or ``etc/conda/activate.d/``) is activated as
``conda activate`` does it, once, on the pristine image while its instance layer is built:
``CONDA_PREFIX``, ``CONDA_DEFAULT_ENV``, ``CONDA_SHLVL`` and ``CONDA_PROMPT_MODIFIER`` set, the
env's ``bin`` first on PATH, then each ``activate.d/*.sh`` sourced (with bash where the image
has it). What that leaves in the environment is kept with the layer (``probe_script``'s
``activated=`` line) and given to every command of every sandbox of the image, the agent's and
the grader's alike; nothing an agent changes in its own sandbox reaches another.

The scrub (run once per image, in a build container without network, committed as the
instance layer) replaces the repository's git data by one commit whose tree is the working tree
as the image has it (tracked files as they are on disk, new files that no ignore rule covers;
ignored build outputs stay on disk, ignored). Only that tree's objects are copied into a fresh
git folder; the old git folder, its common folder and every object store it borrows from
(``objects/info/alternates``) are deleted, so no commit, ref, reflog, stash, packed ref or
unreachable object of the image's history is left in the container's file system.
"""

from __future__ import annotations

import shlex

from legorl.sandbox.common import WORKDIR

#: Where official images keep the repository's Python environment, in the order looked for.
ENV_CANDIDATES = (
    "/opt/miniconda3/envs/testbed",
    "/opt/conda/envs/testbed",
    "/testbed/.venv",
    "/root/.venv",
)

#: Bump when the scrub or the probe changes, so instance layers on images are built again.
SCRUB_VERSION = 3

#: Exit codes of the scrub script that are the image's fault, with what they mean.
NO_REPO, NO_BASE, NOT_CLEAN = 3, 4, 5

_IDENTITY = (
    "GIT_AUTHOR_NAME=legorl GIT_AUTHOR_EMAIL=legorl@localhost "
    "GIT_COMMITTER_NAME=legorl GIT_COMMITTER_EMAIL=legorl@localhost "
    "GIT_AUTHOR_DATE=2000-01-01T00:00:00+0000 GIT_COMMITTER_DATE=2000-01-01T00:00:00+0000"
)


#: Run by bash (or sh) with the env's folder as ``$1``: conda's activation of it, then one
#: ``activated=`` line, the JSON object of every variable that activation set or changed.
_ACTIVATE = r"""prefix=$1
name=${prefix##*/}
snapshot() { "$prefix/bin/python" -c 'import json, os; print(json.dumps(dict(os.environ)))'; }
before=$(snapshot)
export CONDA_PREFIX="$prefix" CONDA_DEFAULT_ENV="$name" CONDA_SHLVL=1
export CONDA_PROMPT_MODIFIER="($name) " PATH="$prefix/bin:$PATH"
for script in "$prefix"/etc/conda/activate.d/*.sh; do
  if [ -f "$script" ]; then . "$script"; fi
done
"$prefix/bin/python" -c '
import json, os, sys
before = json.loads(sys.argv[1])
noise = {"_", "SHLVL", "PWD", "OLDPWD"}
changed = {k: v for k, v in os.environ.items() if k not in noise and before.get(k) != v}
print("activated=" + json.dumps(changed, sort_keys=True))
' "$before"
"""


def probe_script(candidates: tuple[str, ...] = ENV_CANDIDATES) -> str:
    """Shell that prints ``env=<folder>`` (the first of ``candidates`` with a ``bin/python``, or
    ``env=``), ``path=<the image's PATH>`` and, for a conda env, ``activated=<JSON object>``:
    what activating it sets (PATH included)."""
    dirs = " ".join(shlex.quote(d) for d in candidates)
    return (
        f'found=""; for d in {dirs}; do if [ -x "$d/bin/python" ]; then found="$d"; break; fi; '
        'done; echo "env=$found"; echo "path=$PATH"\n'
        'if [ -n "$found" ] && { [ -d "$found/conda-meta" ] || '
        '[ -d "$found/etc/conda/activate.d" ]; }; then\n'
        "  shell=$(command -v bash || echo sh)\n"
        f'  "$shell" -c {shlex.quote(_ACTIVATE)} activate "$found" || true\n'
        "fi"
    )


def activation(probe_output: str) -> dict[str, str]:
    """The variables of the probe's ``activated=`` line (its last), or {} without one.
    Raises ``ValueError`` for a line that is not a JSON object of strings."""
    import json

    lines = [ln for ln in probe_output.splitlines() if ln.startswith("activated=")]
    if not lines:
        return {}
    value = json.loads(lines[-1].removeprefix("activated="))
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"the env's activation printed {lines[-1][:120]!r}, not an object")
    return value


def scrub_script(base_commit: str, *, scrub: bool = True) -> str:
    """Shell (sh + git) that locks ``/testbed``'s history down; its last line is
    ``sha=<the one commit> tree=<its tree>``. With ``scrub`` False (the control) it only
    checks the repository and prints the image's own HEAD."""
    base = shlex.quote(base_commit)
    head = f"""set -eu
export HOME=/tmp/legorl-scrub-home GIT_CONFIG_NOSYSTEM=1 GIT_TERMINAL_PROMPT=0
mkdir -p "$HOME"
g() {{ git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c gc.auto=0 "$@"; }}
cd {WORKDIR} 2>/dev/null || {{ echo "the image has no {WORKDIR}"; exit {NO_REPO}; }}
old=$(g rev-parse --absolute-git-dir 2>/dev/null) || {{
  echo "the image has no git repository at {WORKDIR}"; exit {NO_REPO}; }}
g cat-file -e {base}^{{commit}} 2>/dev/null || {{
  echo "base_commit {base_commit} is not in the image's repository at {WORKDIR}"; exit {NO_BASE}; }}
want=$(g rev-parse {base}^{{commit}})
if [ "$(g rev-parse HEAD)" != "$want" ]; then
  g checkout -q --detach "$want" || {{
    echo "cannot check out base_commit {base_commit} over the image's working tree"; exit {NO_BASE}; }}
fi
"""
    if not scrub:
        return head + 'echo "sha=$want tree=$(g rev-parse "$want^{tree}")"\n'
    return (
        head
        + f"""common=$(cd "$old" && cd "$(g rev-parse --git-common-dir)" && pwd -P)
g add -A .
tree=$(g write-tree)
new=/tmp/legorl-scrub/repo
rm -rf /tmp/legorl-scrub && mkdir -p "$new"
g init -q --template= "$new"
g rev-list --objects "$tree" | g pack-objects -q "$new/.git/objects/pack/pack" >/dev/null
export {_IDENTITY}
sha=$(echo base | g --git-dir="$new/.git" commit-tree "$tree")
g --git-dir="$new/.git" update-ref refs/heads/main "$sha"
g --git-dir="$new/.git" symbolic-ref HEAD refs/heads/main
mkdir -p "$new/.git/info"
if [ -f "$common/info/exclude" ]; then cp "$common/info/exclude" "$new/.git/info/exclude"; fi
for store in $(cat "$common/objects/info/alternates" 2>/dev/null); do
  case "$store" in /*) ;; *) store="$common/objects/$store" ;; esac
  rm -rf "$store"
  parent=$(dirname "$store")
  if [ -f "$parent/HEAD" ] && [ "$(basename "$store")" = objects ]; then rm -rf "$parent"; fi
done
rm -rf "$old" "$common" {WORKDIR}/.git
mv "$new/.git" {WORKDIR}/.git
rm -rf /tmp/legorl-scrub "$HOME"
rm -rf {WORKDIR}/.git/logs
g config user.name legorl
g config user.email legorl@localhost
g read-tree main
g update-index -q --refresh >/dev/null || true
if [ -n "$(g status --porcelain)" ]; then
  echo "the scrubbed repository is not clean:"; g status --porcelain | head -5; exit {NOT_CLEAN}
fi
echo "sha=$sha tree=$tree"
"""
    )


def build_hint(image: str) -> str:
    """What to run to get ``image`` onto a machine whose registry may be unreachable."""
    name = image.rsplit("/", 1)[-1]
    how = f"`docker pull {image}` where a registry is reachable, then `docker save` it here and `docker load` it"
    if name.startswith("sweb.eval."):
        iid = name.split(":", 1)[0].split(".", 3)[-1]
        how += (
            ", or build it with swebench (`python -m swebench.image_builder.prepare_images "
            f"--task_repo TASK_REPO --instance_ids {iid}` makes sweb.eval.x86_64.{iid}:latest)"
        )
    return how


def missing_message(image: str, why: str) -> str:
    """One line: the image, why it is not here, what to build or pull."""
    return f"image {image} is not present and cannot be pulled ({why}); get it with {build_hint(image)}"
