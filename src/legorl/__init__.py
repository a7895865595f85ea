"""legorl: harness-native reinforcement learning for coding agents.

Stages (`legorl proxy | sandbox | rollout | verify | align | train | inspect | check`) are pure
functions over the JSONL records of `legorl.records`, each behind a thin Typer command in `legorl.cli`.
"""

__version__ = "0.1.0"
