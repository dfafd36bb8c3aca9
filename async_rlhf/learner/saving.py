"""A learner rank's checkpoints and its Hugging Face export: the DeepSpeed state (model, optimizer, step, version;
PPO's critic and reward moments) saved and restored, and the policy written as a model directory.

Apart from ``actor.py`` because none of it is the training step: the driver commits, resumes and exports through
these (``driver/checkpoints.py``, ``driver/progress.py``, ``driver/cluster.py``) and ``train()`` saves when a
checkpoint is due. They are :class:`~async_rlhf.learner.actor.LearnerActor`'s methods (remote-callable like the
others) through this mixin, and read its engine, rank and counters.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from async_rlhf.config import Config


class Checkpointing:
    """Checkpoint save / load and the Hugging Face export of :class:`~async_rlhf.learner.actor.LearnerActor`
    (its base class). Every method is collective: every rank calls it."""

    cfg: Config
    engine: Any
    ppo: Any
    merged: Any
    rank: int
    model_path: str
    step: int
    version: int

    # -- checkpoints (the driver commits them: manifest, rename, prune; see async_rlhf/driver/checkpoints.py) ----
    def save_checkpoint(self, out_dir: str) -> float:
        """Model, optimizer, step and version (DeepSpeed, collective on every rank) and, from rank 0, the
        policy as a Hugging Face directory, all under ``out_dir``; returns the seconds it took."""
        t0 = time.perf_counter()
        out = Path(out_dir)
        self.engine.save_checkpoint(str(out / "deepspeed"), tag="state",
                                    client_state={"step": self.step, "version": self.version})
        if self.ppo is not None:  # the critic and the reward moments (learner/ppo.py)
            self.ppo.save(out, self.rank)
        self.save_hf(str(out / "policy"))
        return time.perf_counter() - t0

    def load_checkpoint(self, ckpt_dir: str) -> dict[str, int]:
        """Restore model, optimizer, step and version (and PPO's critic and reward moments) from a committed
        checkpoint before train()."""
        _, client = self.engine.load_checkpoint(str(Path(ckpt_dir) / "deepspeed"), tag="state")
        if client is None:
            raise RuntimeError(f"{ckpt_dir}: DeepSpeed found no state to load")
        self.step, self.version = int(client["step"]), int(client["version"])
        critic = self.ppo.load(Path(ckpt_dir), self.rank) if self.ppo is not None else None
        return {"step": self.step, "version": self.version, "critic_restored": critic}

    def save_hf(self, out_dir: str) -> str:
        """Write the policy as a Hugging Face model directory (tokenizer files, chat template and generation
        config copied from the input, so it loads and stops as the input did; with LoRA the merged model); under
        ZeRO-3 a window of parameters at a time, one shard each (collective: every rank calls it)."""
        from async_rlhf.learner.lora import export_merged
        from async_rlhf.learner.zero3 import save_hf_windowed
        from async_rlhf.tokenizer import copy_tokenizer_files

        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.cfg.learner.zero_stage == 3:  # (LoRA refuses ZeRO-3 at config load)
            save_hf_windowed(self.engine.module, tmp, self.cfg.learner.zero3_gather_mb << 20, self.rank == 0)
        elif self.rank == 0 and self.merged is not None:  # the merged model (and the adapter alone in adapter/)
            export_merged(self.engine.module, str(tmp), self.merged)
        elif self.rank == 0:  # ZeRO 0-2: every rank holds the full parameters
            self.engine.module.save_pretrained(tmp)
        if self.rank == 0:
            copy_tokenizer_files(self.model_path, tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        return str(out)
