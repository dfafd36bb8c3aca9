"""The driver: the process that starts a run, watches it and finishes it (``launch/cluster.py`` is its command line).

    cluster.py         the Cluster: Ray, placement groups, every role started and wired to the others
    runner.py          the training loop: poll every role, metrics, checkpoints, plots, summary.json
    fleet.py           the generator fleet under control: scale, heal, stop; the control endpoint (ZeroMQ)
    progress.py        per-step progress: checkpoint commits, the prompt ledger, the resume position
    checkpoints.py     committing, pruning and resolving checkpoints (layout: async_rlhf/checkpoint_layout.py)
    placement.py       Ray resources and placement groups per role, node by node
    cpu_plan.py        which cores and threads each actor gets (specs parsed in async_rlhf/cpu_spec.py)
    buffer_watch.py    the buffer role's health: restarting or dead
    stopping.py        SIGINT/SIGTERM, `cluster.py stop`, train.max_time_s
    stall.py           the stall watchdog's diagnosis
    progress_rates.py  the progress line's rates
    prompt_ledger.py   which prompt was issued, trained, skipped
    metrics.py         metrics.jsonl and TensorBoard

Roles (learner/, generator/, buffer/, sync/) never import from here.
"""
