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

from async_rlhf.config import Config, ConfigError
from async_rlhf.driver.checkpoints import commit, list_checkpoints, read_manifest, truncate_jsonl
from async_rlhf.driver.fleet import MAX_GENERATORS
from async_rlhf.driver.handles import RoleCluster
from async_rlhf.driver.prompt_ledger import PromptLedger
from async_rlhf.generator.lanes import Layout
from async_rlhf.generator.stream import key_of_group

log = logging.getLogger(__name__)

DATA_LEDGER = "data_ledger.jsonl"
METRICS = "metrics.jsonl"


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with path.open() as fh:
        return sum(1 for _ in fh)


def check_learners(manifest: dict[str, Any], cfg: Config, ckpt: Path | str) -> None:
    """Refuse a resume on another learner world size: each rank loads the ZeRO shards of its own rank, saved
    for the world size the checkpoint records (DeepSpeed's universal checkpoints are not written)."""
    saved = manifest.get("learners")
    if saved is not None and int(saved) != cfg.learners:
        raise ConfigError(f"--resume {ckpt}: the checkpoint was written by {saved} learner rank(s) and this run has "
                          f"--learners {cfg.learners}; its ZeRO optimizer and model shards are per rank: resume with "
                          f"--learners {saved}")


def saved_layout(manifest: dict[str, Any]) -> Layout:
    """The layout a checkpoint's prompt positions follow; one written before it was recorded: strides of the
    generators its ledger knew (the configured fleet, unless the run had scaled)."""
    if "layout" in manifest:
        return Layout.from_dict(manifest["layout"])
    return Layout.default(int(manifest.get("generators") or len(manifest.get("data") or {}) or 1))


@dataclass
class TrainProgress:
    cfg: Config
    cluster: RoleCluster
    run_dir: Path
    ledger: PromptLedger = field(default_factory=PromptLedger)
    step: int = 0
    version: int | None = None
    rolled_back: set[str] = field(default_factory=set)
    """Group ids a durable buffer saw trained after the checkpoint resumed from: undone with the model, so
    their prompts are issued again (never taken for "already in the buffer")."""
    _data: Any = None

    @classmethod
    def start(cls, cfg: Config, cluster: RoleCluster, run_dir: Path, resume: Path | None = None) -> TrainProgress:
        import ray

        prog = cls(cfg, cluster, run_dir)
        if resume is not None:
            manifest = read_manifest(resume)
            check_learners(manifest, cfg, resume)  # before any rank meets shards saved for another world size
            states = ray.get([lr.load_checkpoint.remote(str(resume)) for lr in cluster.learners])
            prog.step, prog.version = states[0]["step"], states[0]["version"]
            prog.ledger = PromptLedger.from_state(manifest["data"])
            prog.ledger.layout = saved_layout(manifest)  # the fleet size its positions are strides of
            truncate_jsonl(run_dir / METRICS, int(manifest["metrics_lines"]))
            truncate_jsonl(run_dir / DATA_LEDGER, int(manifest["data_lines"]))
            # the buffer takes the checkpoint's version and consumed groups; a durable (Redis) one also gives
            # back what the killed learners held and drops groups made by weights the resume rolled back
            restored = ray.get(cluster.buffer.restore_admission.remote(prog.version,
                                                                      prog.step * cfg.train.batch_size))
            # trained after the checkpoint: open in its ledger (asked for alone, not the whole trained history)
            windows = prog.ledger.windows(range(MAX_GENERATORS))
            prog.rolled_back = set(ray.get(cluster.buffer.stats.remote(True, windows))["ledger"]["trained"])
            print(f"resumed from {resume}: step {prog.step}, version {prog.version}", flush=True)
            if states[0].get("critic_restored") is False:
                print(f"{resume} holds no PPO critic (written before checkpoints kept it): the critic starts "
                      "again from a zero value head and the reward moments from nothing", flush=True)
            if restored["kept"] or restored["rolled_back"] or restored["reward_lost"] or prog.rolled_back:
                print(f"buffer kept {restored['kept']} group(s) of the interrupted run; dropped "
                      f"{restored['rolled_back']} made by weights newer than the checkpoint (rolled_back) and "
                      f"{restored['reward_lost']} awaiting a reward (reward_lost); {len(prog.rolled_back)} "
                      "trained after the checkpoint are trained again", flush=True)
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
        per_rank = [d.get(step, {}) for d in ray.get([lr.trained_ids.remote(step, step)
                                                     for lr in self.cluster.learners])]
        ids = [gid for d in per_rank for gid in d.get("group_ids", [])]
        skipped = [gid for d in per_rank for gid in d.get("skipped_ids", [])]
        self.ledger.observe_trained(ids + skipped)  # a skipped (zero-advantage) prompt is used up too
        self._data.write(json.dumps({"step": step, "version": rec.get("version"), "group_ids": ids,
                                     "prompt_keys": [key_of_group(g) for g in ids], "skipped_ids": skipped}) + "\n")
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
            # how a file or Python source is dealt: the fleet size the positions are strides of (generator/lanes.py)
            **({"layout": self.ledger.layout.to_dict()} if self.ledger.layout is not None else {}),
            "learners": self.cfg.learners,
        }
        before = set(list_checkpoints(self.run_dir))
        final = commit(self.run_dir, step, manifest, self.cfg.run.keep_checkpoints)
        log.info("checkpoint %s committed", final)
        deleted = sorted(before - set(list_checkpoints(self.run_dir)) - {final})
        if deleted:
            print(f"checkpoint {final.name} written; deleted {', '.join(p.name for p in deleted)} "
                  f"(run.keep_checkpoints={self.cfg.run.keep_checkpoints} keeps the newest)", flush=True)

    def failure_hint(self) -> str:
        done = list_checkpoints(self.run_dir)
        if not done:
            return "a learner failed before the first checkpoint; nothing to resume (set run.checkpoint_every)"
        return (f"a learner failed: the job stops; resume it with python launch/cluster.py --resume {done[-1]} "
                f"(step {read_manifest(done[-1])['step']})")

    def close(self) -> None:
        if self._data is not None:
            self._data.close()
