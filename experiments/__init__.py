"""Research scripts behind the measurements in docs/experiments.md; not part of the legorl wheel.

Each runs from the repository root as ``python -m experiments.NAME``: make_agent_model (the
supervised training that made ``fixtures/models/tiny-agent``), compare_updates (trainer updates
side by side on one batch of rollouts, scored without the harness) and scale_final_norm (a model
copy sampled colder by construction).
"""
