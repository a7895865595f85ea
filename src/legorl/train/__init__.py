"""`legorl train`: GSPO, GRPO and Dr.GRPO on Sample records, with π_old recomputed by the trainer.

    legorl train samples.jsonl --model fixtures/models/tiny-qwen3 --out ckpt --metrics m.jsonl

The loop is ``trainer.train``; the math it calls is pure tensor functions in ``losses`` and
``correction``. Importing this package imports nothing heavy.
"""
