"""Shared fixtures: a tiny causal LM built locally (no hub), cached for the whole session."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 policy with random weights (tests that need competence build their own)."""
    import torch

    from async_rlhf.tiny.model import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny randomly initialised sequence classifier (num_labels=1) over the tiny tokenizer: a reward model."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    from async_rlhf.tiny.model import tiny_config
    from async_rlhf.tiny.tokenizer import build_tokenizer, save_tokenizer

    out = tmp_path_factory.mktemp("reward_model")
    tok = build_tokenizer()
    cfg = tiny_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    cfg.num_labels = 1
    torch.manual_seed(1)
    Qwen2ForSequenceClassification(cfg).save_pretrained(str(out))
    save_tokenizer(tok, out)
    return out


SHARED_FIXTURES = {"shared_ray", "ray_address"}
"""Fixtures one instance of which serves many tests (docs/testing.md, "Shared fixtures")."""
SHARED_RAY_CPUS = 16
"""Logical CPUs of the shared Ray: room for the largest plan of a test that uses it (three generators, two learner
ranks, the buffer, a generator added by ``scale``); the roles share this machine's cores (CPU plan)."""


@pytest.fixture(scope="session")
def shared_ray():
    """One local Ray for the whole session, started by the first test that asks for it; yields its GCS address
    (a subprocess joins it with ``RAY_ADDRESS``, as the launcher does under ``ray job submit``).

    Shared by every test that only needs a Ray to run its roles on (``Cluster`` uses the Ray it finds): each test
    ends its run with ``Cluster.close`` (kills that run's actors, removes its placement groups) and never calls
    ``ray.shutdown``. Isolation rule: a test that kills, pauses or reconfigures Ray itself, a node or a process
    outside its own run's actors, or that needs the roles' environment of its own (caches, ports), starts a Ray
    of its own (a launcher job in its own session) and is marked ``isolated``."""
    import ray

    from async_rlhf.driver.local_ray import start_local_ray

    assert not ray.is_initialized(), "a Ray was started in this process before the shared one"
    start_local_ray(SHARED_RAY_CPUS, {"TOKENIZERS_PARALLELISM": "false"})  # as the launcher starts its own
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_address(shared_ray: str) -> str:
    """The shared Ray's address, checked to be up (a test that shut it down would break every later one)."""
    import ray

    assert ray.is_initialized(), "the shared Ray was shut down by an earlier test: use Cluster.close, not shutdown"
    return shared_ray


@pytest.fixture(scope="session")
def load_bench() -> Callable[[str], ModuleType]:
    """Import a script of bench/ by file name (bench/ is not a package), for tests of its arithmetic."""
    import importlib.util

    def load(script: str) -> ModuleType:
        path = Path(__file__).resolve().parents[1] / "bench" / script
        spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
        assert spec is not None and spec.loader is not None, f"no bench script {path}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
        spec.loader.exec_module(module)
        return module

    return load


# bench/vs_trl.py and its modules, for the two vs_trl test files (loaded once per test module)
@pytest.fixture(scope="module")
def bench(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("vs_trl.py")


@pytest.fixture(scope="module")
def stats(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("vs_trl_stats.py")


@pytest.fixture(scope="module")
def process_cpu(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("process_cpu.py")


@pytest.fixture(scope="module")
def vs_report(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("vs_trl_report.py")


@pytest.fixture(scope="session")
def llama_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ~1 M-parameter Llama with a byte-level BPE tokenizer, chat template and generation config
    (async_rlhf/tiny/llama_bpe.py), random weights."""
    import torch

    from async_rlhf.tiny.llama_bpe import prepare_llama_bpe

    torch.set_num_threads(1)
    return prepare_llama_bpe(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def ragged_batch():
    """``make(vocab, seed=0)``: a collated batch of 3 prompt groups x 3 completions of 1-9 tokens (prompts of
    2-5), the longer completions with an observation span (loss mask 0) inside, random behaviour log-probs."""
    import numpy as np

    from async_rlhf.learner.batch import collate
    from async_rlhf.types import Group, Sample

    def make(vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        groups = []
        for gi, (prompt_len, comp_lens) in enumerate([(3, [1, 6, 2]), (5, [4, 9, 3]), (2, [7, 1, 5])]):
            samples = []
            for j, n in enumerate(comp_lens):
                mask = np.ones(n, np.uint8)
                if n >= 6:
                    mask[2:4] = 0
                samples.append(Sample(rng.integers(4, vocab, n).astype(np.int32),
                                      -rng.random(n).astype(np.float32), np.zeros(n, np.int32), float(j == gi),
                                      loss_mask=mask))
            groups.append(Group(f"g{gi}", rng.integers(4, vocab, prompt_len).astype(np.int32), samples))
        return collate(groups, pad_id=0, advantage="grpo")

    return make


@pytest.fixture(scope="module")
def module_process_group():
    """For a module that makes a default process group in the test process (DeepSpeed needs one): the group, and
    DeepSpeed's references to it, go away with the module, and so do the RANK, MASTER_PORT... variables it sets
    (a later module's DeepSpeed would otherwise find a destroyed group, and a process the suite starts later
    would inherit the port)."""
    saved = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def sequence_logprobs(model, seqs: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
    """A transformers model's log-prob of every token after the first of each sequence, in float32, of
    softmax(logits / temperature): the reference vLLM's log-probs are checked against (one forward per sequence,
    so they may differ in length)."""
    import torch

    out = []
    with torch.no_grad():
        for seq in seqs:
            logits = model(torch.tensor([seq])).logits[0].float()
            logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, -1)
            out.append([logp[i - 1, seq[i]].item() for i in range(1, len(seq))])
    return out


def wait_for(cond, what: str, timeout_s: float = 240.0) -> None:
    """Poll ``cond`` every 0.2 s until it holds; TimeoutError naming ``what`` after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def stop_process(proc, grace_s: float = 5.0) -> None:
    """Join a child process; terminate, then kill it if it outlives ``grace_s`` at each stage."""
    proc.join(timeout=grace_s)
    for end in (proc.terminate, proc.kill):
        if not proc.is_alive():
            return
        end()
        proc.join(timeout=grace_s)


def joins_noticed(sender) -> bool:
    """Whether the sender's join watcher saw requests queued since the sender last took them (its next push
    admits them). Reaches into the Sender: only tests wait for this moment."""
    return sender._joins_seen.is_set()


def poll_joiners(sender) -> list[str]:
    """Take the join requests queued now (a store round trip, as the sender's push does once its watcher saw
    some) and return every member id waiting for admission at the next push: a request already queued is then
    admitted by the very next push, whatever the watcher's timing. Reaches into the Sender, as above."""
    sender._take_joiners()
    return [m.id for m in sender._queued]


TIERS = ("unit", "distributed", "integration", "cluster", "gpu")
"""A test's tier is its folder under tests/ (``make test-fast`` runs ``-m unit``)."""


RUN_ORDER = ("cluster", "integration", "distributed", "gpu", "unit")
"""The tiers' order in a run, longest files first (the cluster module alone takes about 5 minutes): with
``make test TEST_WORKERS=2`` (``--dist loadfile --no-loadscope-reorder``) the short unit files then fill the end and
both workers finish together; one file after another, the failures that need the real stack come first."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    tiers = {}
    for item in items:
        parts = Path(str(item.fspath)).relative_to(root).parts
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))
            tiers[item.nodeid] = parts[0]
        check_isolation(item)
    items.sort(key=lambda item: RUN_ORDER.index(tiers[item.nodeid]) if item.nodeid in tiers else len(RUN_ORDER))


def check_isolation(item: pytest.Item) -> None:
    """The isolation rule, enforced at collection: a test marked ``isolated`` (it kills, pauses or reconfigures
    a process) must not use a shared fixture."""
    shared = sorted(set(getattr(item, "fixturenames", ())) & SHARED_FIXTURES)
    if item.get_closest_marker("isolated") and shared:
        raise pytest.UsageError(f"{item.nodeid} is marked isolated but uses the shared fixture(s) {shared}: start "
                                "its own (an isolated test kills, pauses or reconfigures what it runs on)")
