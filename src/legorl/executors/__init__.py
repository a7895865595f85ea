"""Where rollout and grading work runs: in this process (``legorl.rollout``,
``legorl.verify``), or over the nodes of a Ray cluster (``legorl.executors.ray``, imported only
when ``--ray`` asks for it)."""
