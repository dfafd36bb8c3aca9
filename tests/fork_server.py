"""One fork server for the child processes the tests start (learner ranks, the vLLM test engines): each child is a
fork of a server that imported torch, DeepSpeed, transformers and vLLM once, not a spawned process importing them
again (7-9 s of a core for vLLM, several for DeepSpeed, on 2 shared cores). A fork has nothing initialised: it
builds its own DeepSpeed engine or ``vllm.LLM``; importing these modules starts no thread in the server.

multiprocessing keeps one fork server per process, started by the first child; its preload list and environment are
fixed then. So every user asks for it here, with one list and one environment, whoever comes first.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import forkserver

PRELOAD = [
    "torch", "transformers", "deepspeed",
    # the learner's side (tests/learner_ranks.py, test_zero3_windowed_push.py)
    "async_rlhf.learner.actor", "async_rlhf.learner.push", "async_rlhf.learner.zero3", "learner_ranks",
    # building a CPU engine of the tiny Qwen2 (``import vllm`` alone is lazy) and the test engines' module
    "vllm.entrypoints.llm", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.model_loader", "vllm.model_executor.models.qwen2", "async_rlhf.generator.worker_ext",
    "vllm_engine",
    "frozen_heap",  # last: the garbage collector's walks in the children skip everything imported above
]
SERVER_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
"""What is read while importing: vLLM configures its logger on import, OpenMP reads its thread count when torch
loads it. A child sets the rest of its environment itself, before it builds what reads it."""
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torch.distributed variables a test process may hold (a DeepSpeed group of its own): never the children's."""


def fork_context() -> mp.context.BaseContext:
    """The forkserver context, its server running with ``PRELOAD`` imported under ``SERVER_ENV`` (started now if
    this is the first call of the session). Queues for its processes come from it too."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.update(SERVER_ENV)
    for key in RANK_ENV:
        os.environ.pop(key, None)
    try:
        forkserver.ensure_running()  # the server inherits this environment (only when it starts)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return ctx
