"""A resume with another ``--generators`` on a file of prompts (issue 44, defect 7), through the real launcher.

    run 1: 2 generators, 200 records, 6 steps (checkpoint every 3): positions are strides of 2
    run 2: --resume with --generators 3 for 10 more steps: the open positions of the old lanes, and the places the
           slower lane never reached, are dealt to the new fleet first, then the rest of the file's sequence

Before, run 2's generators took lanes of 3 from position 0 of their own streams while their positions went on: some
records were trained twice in the epoch, others never, and generator 1's outstanding prompts fell to a lane of
another stride. Checked: the checkpoint records the layout; no prompt key is used twice; every key trained maps to a
distinct record index of the sequence; and each prompt the generators actually generated in run 2 (the reward
function logs it) is one of the records the new layout deals to them, so the engines drew what the ledger says.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from jobs import LAUNCH, data_ledger

from async_rlhf.driver.checkpoints import list_checkpoints, read_manifest
from async_rlhf.generator.lanes import Layout, file_prompts_at
from async_rlhf.generator.stream import keys_of_group

pytestmark = pytest.mark.integration

RECORDS = 200
STEPS = 16
REWARD = '''
def score(prompt, completion, data):
    with open({log!r}, "a") as fh:
        fh.write(data["rid"] + "\\n")
    return float(len(completion) % 3) / 2
'''


def _launch(work: Path, ray_address: str, *args: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([*LAUNCH, *args], cwd=work, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_ADDRESS": ray_address})


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, ray_address: str) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("resume_fleet")
    (work / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{i % 10}+{i // 10 % 10}=", "rid": f"r{i}"})
                                              + "\n" for i in range(RECORDS)))
    log = work / "scored.txt"
    (work / "reward.py").write_text(REWARD.format(log=str(log)))
    run_dir = work / "run"
    common = ["task.name=custom", "prompts.source=file", f"prompts.path={work / 'train.jsonl'}",
              "rewards.sources=function", f"rewards.function={work / 'reward.py'}:score", "generator.eval_every=0",
              "generator.max_new_tokens=3", "train.batch_size=4", "train.group_size=2", "train.max_staleness=1",
              "generator.groups_in_flight=3", "run.checkpoint_every=3", "run.keep_checkpoints=10", "run.log_every_s=5"]
    first = _launch(work, ray_address, "--generators", "2", "--learners", "1", "--model", str(tiny_model_dir),
                    "--run-dir", str(run_dir), "train.steps=6", *common)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    ckpt1 = read_manifest(list_checkpoints(run_dir)[-1])
    log.rename(work / "scored_first.txt")
    # one group in flight per generator: the admission window is shared by all three (else the first engine up
    # takes every slot of so short a run)
    second = _launch(work, ray_address, "--resume", str(run_dir), "--generators", "3", f"train.steps={STEPS}",
                     "generator.groups_in_flight=1")
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    return {"run_dir": run_dir, "ckpt1": ckpt1, "ckpt2": read_manifest(list_checkpoints(run_dir)[-1]),
            "second": second.stdout + second.stderr, "scored": log.read_text().split()}


def _global(layout: Layout, gen: int, seq: int) -> int:
    """The record index (in the source's sequence) of key ``gen:seq`` drawn under ``layout``."""
    base = layout.base.get(gen, 0)
    assert seq > base, f"{gen}:{seq} was drawn before this layout"
    return layout.at(gen + (seq - base - 1) * layout.lanes)


def test_the_checkpoints_record_the_fleet_their_positions_are_strides_of(resumed: dict[str, Any]) -> None:
    assert resumed["ckpt1"]["layout"]["lanes"] == 2
    assert resumed["ckpt2"]["layout"]["lanes"] == 3
    assert "resumed on 3 generator(s) where the checkpoint's prompt positions are strides of 2" in resumed["second"]


def test_every_record_is_trained_at_most_once_and_as_dealt(resumed: dict[str, Any]) -> None:
    run_dir = resumed["run_dir"]
    lines = data_ledger(run_dir)
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    after = {g.split("-")[0] for x in lines if x["step"] > 6 for g in x["group_ids"] + x.get("skipped_ids", [])}
    assert after == {"g0", "g1", "g2"}, f"every generator of the new fleet trained prompts: {after}"
    used = [(x["step"], k) for x in lines for g in x["group_ids"] + x.get("skipped_ids", []) for k in keys_of_group(g)]
    assert len(used) == len({k for _, k in used}), "a prompt key was used twice"
    # run 1's keys follow its layout, run 2's the resume's (a checkpoint without one, as before the fix: strides
    # of its generators from each stream's start)
    layouts = [Layout.from_dict(m["layout"]) if "layout" in m else Layout.default(int(m["generators"]))
               for m in (resumed["ckpt1"], resumed["ckpt2"])]
    trained = [_global(layouts[step > 6], int(g), int(s)) for step, (g, s) in ((t, k.split(":")) for t, k in used)]
    assert len(trained) == len(set(trained)), "a record of the epoch was trained twice"
    # what run 2's engines generated is what the new layout deals to them (their positions after the base)
    new = layouts[1]
    records = [{"prompt": "x", "rid": f"r{i}"} for i in range(RECORDS)]
    dealt: set[str] = set()
    for gen in range(3):
        drawn = int(resumed["ckpt2"]["data"].get(str(gen), {}).get("position", 0)) - new.base.get(gen, 0)
        idx = itertools.islice(new.lane_globals(gen), drawn + 20)
        dealt |= {p.data["rid"] for p in file_prompts_at(records, "prompt", 0, idx)}
    scored = set(resumed["scored"])
    assert scored, "run 2 generated prompts"
    assert scored <= dealt, f"run 2 generated records it was not dealt: {sorted(scored - dealt)[:5]}"
