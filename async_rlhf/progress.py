"""What the driver's progress loop keeps across a run: the prompt ledger, checkpoints, resume.

    learner record of step s  ->  trained group ids of s (every rank)  ->  prompt ledger, data_ledger.jsonl
                              ->  metrics.jsonl
                              ->  "checkpoint/step" in it?  commit run_dir/checkpoints/step-s with the
                                  data position *as of step s* (records are handled in step order)

Resume: learners load model + optimizer + step + version, the generators start from the checkpoint's policy
at its version and continue their prompt streams (re-issuing what was drawn but not trained), and the
metrics and data ledger files are cut back to the checkpoint so the new records continue them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_rlhf.checkpoint import commit, list_checkpoints, read_manifest, truncate_jsonl
from async_rlhf.config import Config
from async_rlhf.prompt_ledger import PromptLedger

log = logging.getLogger(__name__)

DATA_LEDGER = "data_ledger.jsonl"
METRICS = "metrics.jsonl"


def _restore_admission(actor: Any, version: int, accepted: int) -> int:
    """Runs inside the buffer actor: a fresh (memory) buffer takes the resumed run's version and the groups
    it has already consumed, so admission opens exactly one window of ``max_staleness + 1`` batches."""
    logic = actor.service.logic

    def apply() -> int:
        if logic.admission.version < version:
            logic.admission.version = version
            logic.admission.accepted = max(logic.admission.accepted, accepted)
        return logic.admission.version

    return actor.service.call(apply)


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with path.open() as fh:
        return sum(1 for _ in fh)


@dataclass
class TrainProgress:
    cfg: Config
    cluster: Any
    run_dir: Path
    ledger: PromptLedger = field(default_factory=PromptLedger)
    step: int = 0
    version: int | None = None
    _data: Any = None

    @classmethod
    def start(cls, cfg: Config, cluster: Any, run_dir: Path, resume: Path | None = None) -> TrainProgress:
        import ray

        prog = cls(cfg, cluster, run_dir)
        if resume is not None:
            manifest = read_manifest(resume)
            states = ray.get([lr.load_checkpoint.remote(str(resume)) for lr in cluster.learners])
            prog.step, prog.version = states[0]["step"], states[0]["version"]
            prog.ledger = PromptLedger.from_state(manifest["data"])
            truncate_jsonl(run_dir / METRICS, int(manifest["metrics_lines"]))
            truncate_jsonl(run_dir / DATA_LEDGER, int(manifest["data_lines"]))
            per_version = cfg.train.batch_size * cfg.train.push_every  # groups consumed per version
            ray.get(cluster.buffer.__ray_call__.remote(_restore_admission, prog.version,
                                                       prog.version * per_version))
            # a durable buffer: batches delivered to the killed learners go to the new ones now
            ray.get([cluster.buffer.declare_dead.remote(f"learner-{r}") for r in range(cfg.learners)])
            print(f"resumed from {resume}: step {prog.step}, version {prog.version}", flush=True)
        prog._data = (run_dir / DATA_LEDGER).open("a")
        return prog

    def generator_stats(self, fleet: Any) -> list[dict[str, Any]]:
        """Stats of the generators that answer within 2 s (a restarting one does not), in id order."""
        import ray

        refs = {g.stats.remote(): gen for gen, g in sorted(fleet.handles.items())}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=2.0)
        stats: dict[int, dict[str, Any]] = {}
        for ref in ready:
            try:
                stats[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayError:
                continue  # died since: the fleet restarts it at its next poll
        fleet.observe(stats)
        return [stats[g] for g in sorted(stats)]

    def before_write(self, rec: dict[str, Any]) -> None:
        """Feed the ledger the group ids every rank trained at this record's step."""
        import ray

        step = int(rec["step"])
        per_rank = ray.get([lr.trained_ids.remote(step, step) for lr in self.cluster.learners])
        ids = [gid for d in per_rank for gid in d.get(step, [])]
        self.ledger.observe_trained(ids)
        self._data.write(json.dumps({"step": step, "version": rec.get("version"), "group_ids": ids}) + "\n")
        self._data.flush()
        rec["data/duplicates"] = len(self.ledger.duplicates)

    def after_write(self, rec: dict[str, Any]) -> None:
        if "checkpoint/step" not in rec:
            return
        step = int(rec["checkpoint/step"])
        manifest = {
            "version": int(rec["version"]),
            "data": self.ledger.to_state(),
            "metrics_lines": _count_lines(self.run_dir / METRICS),
            "data_lines": _count_lines(self.run_dir / DATA_LEDGER),
            "generators": len(self.ledger.positions),
            "learners": self.cfg.learners,
        }
        final = commit(self.run_dir, step, manifest, self.cfg.run.keep_checkpoints)
        log.info("checkpoint %s committed", final)

    def failure_hint(self) -> str:
        done = list_checkpoints(self.run_dir)
        if not done:
            return "a learner failed before the first checkpoint; nothing to resume (set run.checkpoint_every)"
        return (f"a learner failed: the job stops; resume it with python launch/cluster.py --resume {done[-1]} "
                f"(step {read_manifest(done[-1])['step']})")

    def close(self) -> None:
        if self._data is not None:
            self._data.close()
