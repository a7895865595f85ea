"""The RL loop: K iterations of rollout → verify → align → train on a task split, the new weights
reloaded into the running in-process proxy after each training step, with a held-out evaluation
before the first iteration and after the last.

    legorl loop --model fixtures/models/tiny-agent --tasks-dir fixtures/tasks-generated --out runs/loop

One engine and one proxy live for the whole loop; each phase (an iteration's rollouts, an
evaluation) sends its Turns to its own folder. With ``--ray ADDRESS`` every phase runs on a Ray
cluster instead (``legorl.executors.ray``): one worker per node with its own engine, proxy and
sandboxes, each trained checkpoint shipped to every node; the drivers see only the
``Executor`` protocol. Before any engine or sandbox starts, the loop's harness is checked here
(or by each node's worker): a missing one stops it in one line naming the node and the fix. Iteration k trains on ``tasks_per_iteration`` tasks
of ``train.jsonl``, taken round-robin from a seeded shuffle, ``group_size`` samples each. The
held-out evaluation samples ``eval_samples`` runs per ``heldout.jsonl`` task with fixed seeds
(``seed`` + sample index), the same before and after, so the two are comparable; its success is
the fraction of graded runs with reward 1 (environment failures are counted, not graded).
By default the trainer updates only the final norm's gains (``train_params``, see
``LOOP_TRAIN_PARAMS`` in ``legorl.loop_config``, where the options and their defaults live), and
those through one common factor (``scale_only``, a learned inverse temperature);
``--scale-only ''`` trains the gains one by one, ``--train-params ''`` trains every parameter,
and ``--lr-groups`` gives some of them another lr.

Layout under ``out``::

    iter-001/  trajectories.jsonl graded.jsonl samples.jsonl turns/ metrics.jsonl checkpoint/
               trainer_logprobs.jsonl
    eval-before/  eval-after/  (trajectories.jsonl graded.jsonl turns/ eval.json)
    metrics.jsonl  loop.png  state.json  alerts.jsonl (with the first monitor alert)

The top-level ``metrics.jsonl`` holds Metric records of source ``loop``, step = iteration:
``reward_mean`` (graded runs), ``solved_fraction`` (tasks with a solved sample),
``rollout_trainer_pearson`` (the trainer's first step), ``crashes`` (environment failures of the
run or its grading), ``hack_flags`` (flagged runs), ``policy_version`` (after the reload),
``trained``, ``seconds`` and ``{rollout,verify,align,train,reload}_seconds``; and
``heldout_success`` / ``heldout_crashes`` at step 0 (before) and K (after).

``state.json`` is replaced whole after each finished iteration and evaluation. Running again with
the same ``out`` continues where it stopped: finished iterations are kept, the engine starts from
the last checkpoint at its policy version, and inside a half-finished phase finished trajectories
and gradings are kept. A finished loop only reports. Asking for more iterations than a finished
loop ran continues it; its old ``eval-after/`` is kept as ``eval-at-NNN/``.

A group whose samples all have one reward carries no gradient: when no group of an iteration
differs, the weights stay as they are and the trainer only runs dry (for the rollout/trainer
fidelity figures).

The package: ``state`` (the state file, results, metrics, plot), ``stages`` (the stage
functions both drivers run: rollout and grading through an executor, align, train, results),
``runner`` (``run_loop``, the shared runner and the synchronous driver) and ``driver_async``
(``--async``: rollouts run on while the trainer trains, within a staleness bound; see there).
"""

from __future__ import annotations

from legorl.loop.runner import Runner, load_splits, run_loop
from legorl.loop.stages import groups_with_signal
from legorl.loop.state import (
    EVAL_FILE,
    METRICS_FILE,
    PLOT_FILE,
    STATE_FILE,
    EvalResult,
    IterationResult,
    LoopError,
    LoopResult,
    LoopState,
    iteration_tasks,
    loop_metrics,
    write_plot,
)
from legorl.loop_config import LoopConfig, LoopConfigError

__all__ = [
    "EVAL_FILE",
    "METRICS_FILE",
    "PLOT_FILE",
    "STATE_FILE",
    "EvalResult",
    "IterationResult",
    "LoopConfig",
    "LoopConfigError",
    "LoopError",
    "LoopResult",
    "LoopState",
    "Runner",
    "groups_with_signal",
    "iteration_tasks",
    "load_splits",
    "loop_metrics",
    "run_loop",
    "write_plot",
]
