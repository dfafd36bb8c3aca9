"""async_rlhf against TRL's synchronous GRPOTrainer: same task, model, start, hyperparameters and RL time budget.

For each task (``addition``: the demo's 2-digit addition, answers of a few tokens; ``longtail``: answers of
1-40 tokens, heavy-tailed; ``addition3``: 3-digit addition, a warm start that is right 0.19 of the time),
one after the other on this machine:

    start       the project's tiny Qwen2 policy with its SFT warm start (runs/cache), the same for both sides
    TRL         GRPOTrainer (pinned in the ``bench`` extra): 8 prompts x 8 completions per step, lr 1e-4
                constant, temperature 1, beta 0 (no KL), fp32 on CPU, 2 torch threads, transformers generate,
                the task's own reward rule; held-out greedy accuracy after 1 s of training time, then every
                quarter of the time so far, at most every ``--eval-every-s`` (the clock is paused while it
                evaluates: TRL's evaluations are free, ours are not), stopped after ``--budget-s`` of training
    async_rlhf  launch/cluster.py --generators G --learners 1 with the same settings (its defaults otherwise:
                decoupled PPO, dynamic sampling); the budget starts at its first learner step (start-up is not
                counted) and ends with {"op": "stop"} on its control endpoint; held-out accuracy from its
                generator-0 evaluations (``generator.eval_every`` versions), placed at the time of the learner
                step that made that version

Both are scored by ``async_rlhf.tiny.sft.greedy_accuracy``'s rule on the task's held-out split (ours in vLLM,
greedy, the same rule). Printed per task: end accuracy and time of TRL, the time async_rlhf needs to reach it,
time to fixed thresholds (first evaluation at or above; and held: the mean of 3 evaluations in a row, against
what TRL holds over its second half, since one evaluation swings by up to 0.1), samples/s trained (and
generated, for ours: dynamic sampling trains only groups whose rewards differ), the learner's push-wait and
compute fractions, and what each side spent of the machine over its training time: cores kept busy and CPU ms
per sample (TRL's process without its evaluations; our driver's whole process tree, Ray and every actor).

Over seeds (``--seeds K``): each task runs both sides K times, with ``train.seed=S`` for S = 0..K-1 in the
config of both (TRL: its torch seed, its prompt order and GRPOConfig's seed; ours: prompt order, sampling and
the learner), interleaved per seed (TRL seed 0, ours seed 0, TRL seed 1, ...) so that a drift of the machine
hits both sides. Every seed of a task starts from the same policy, seed 0's warm start: what varies is RL's
randomness, not the start (``--vary-start``: each seed from its own warm start, ``train.seed=S``'s, built and
cached on first use; ``--model`` starts every seed from that directory). Per task and side it reports, per
seed and as mean and sample standard deviation (n - 1; none below two values): the time to the task's target
accuracy (first evaluation at or above it, one target for all seeds: ``TARGETS`` or ``--target``; a seed that
never reached it is left out of the mean and counted as never), the end accuracy, the accuracy at equal
training time (each side's last evaluation at or before the shorter of the two sides' training times) and at
equal samples trained (each side's last evaluation at or before the smaller of the two sides' samples trained:
TRL trains batch x group samples a step, ours the cumulative ``rollout/samples`` of its learner steps).

CPU per generated sample by process: our side's process tree is read every ``SAMPLE_EVERY_S`` over the training
window (a process that appears later counts from 0; one that ends keeps its last reading) and each process is
put in a kind by :func:`classify` on its name and command line (Ray's and vLLM's process titles): ``engine``
(generator actors, vLLM's engine core), ``learner``, ``buffer``, ``ray`` (raylet, gcs_server, Ray's agents, log
monitor, idle workers), ``driver`` (the launcher), ``forkserver`` (the role fork server and its wrappers) and
``other`` (start-up and evaluation tasks, helpers); TRL is one process, ``trl``.

    pip install -e '.[cpu,dev,bench]'
    python bench/vs_trl.py [--quick] [--budget-s 600] [--tasks addition,longtail,addition3]
                           [--seeds 3] [--vary-start] [--target 0.9 | --target addition=0.8,longtail=0.9]
                           [--ours-set generator.groups_in_flight=24 ...] [--out runs/vs_trl/results.json]

Writes ``--out``: JSON ``{"machine", "commit", "budget_s", "seeds", "targets", "tasks": [...]}``; each task
entry holds seed 0's comparison in the keys of a single run (``"task", "trl_accuracy_end", "trl_time_s",
"time_to_trl_accuracy_s", "trl_samples_per_s", "ours_samples_per_s", "learner_push_wait_fraction", ...curves``),
``"per_seed"`` (that comparison for every seed), ``"trl"`` and ``"ours"`` (``time_to_target_s`` per seed, null
for never, ``accuracy_end``, ``accuracy_at_equal_time``, ``accuracy_at_equal_samples`` and each one's ``_mean``
and ``_std``, ``never_reached``) and ``"cpu_ms_per_generated_sample_by_process"`` (means over seeds, by kind).
Beside it: ``<task>_curves.png`` (seed 0's two curves) and ``<task>_seeds.png`` (every seed's curves, against
training time and against samples trained).

Here: the two sides' runs, the comparison of a task over its seeds and the command line; the CPU by kind of
process (:func:`classify`, the sampler) is bench/process_cpu.py, the readings over seeds and the targets
(``TARGETS``, the time ratio) bench/vs_trl_stats.py, the printed tables and the figures bench/vs_trl_report.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import describe, finish, git_commit, machine_record, stamp  # noqa: E402
from bench.process_cpu import SAMPLE_EVERY_S, ProcessCpu  # noqa: E402
from bench.vs_trl_report import plot, plot_seeds, report, report_seeds, seed_line  # noqa: E402
from bench.vs_trl_stats import (  # noqa: E402
    SAMPLES_NOTE,
    STD_NOTE,
    TARGETS,
    pair_row,
    parse_targets,
    target_for,
    task_entry,
    task_ratio,
)

TASKS = {"addition": ["task.name=addition", "generator.max_new_tokens=6"],
         "longtail": ["task.name=longtail", "generator.max_new_tokens=41"],
         # 3-digit addition: its warm start is right on 0.19 of held-out problems, so RL takes minutes, not
         # seconds (the other two saturate within seconds on both sides)
         "addition3": ["task.name=addition", "task.digits=3", "generator.max_new_tokens=7"]}
SHARED = ["train.batch_size=8", "train.group_size=8", "train.lr=1e-4", "generator.temperature=1.0",
          "train.objective.kl_coef=0"]


def task_config(task: str, ours_set: tuple[str, ...] = (), seed: int = 0) -> Any:
    """The task's config with the shared settings and ``train.seed=seed``; ``ours_set`` on top gives our run's
    config (never TRL's)."""
    from async_rlhf.config import load_config

    return load_config(None, seeded(task, seed) + list(ours_set))


def seeded(task: str, seed: int) -> list[str]:
    """The settings both sides share for this task and seed (TRL's config, our run's command line)."""
    return TASKS[task] + SHARED + [f"train.seed={seed}"]


def start_policy(cfg: Any) -> str:
    from async_rlhf.policy_source import resolve_model

    return resolve_model(cfg, ROOT / "runs" / "cache")


# -- TRL -----------------------------------------------------------------------------------------------
def run_trl(cfg: Any, model_dir: str, budget_s: float, eval_every_s: float, work: Path) -> dict[str, Any]:
    import itertools

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_rlhf.env.arithmetic import score_completion
    from async_rlhf.env.registry import make_task
    from async_rlhf.tiny.sft import greedy_accuracy
    from async_rlhf.tokenizer import load_tokenizer

    torch.set_num_threads(2)
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task)
    heldout = task.heldout()
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    problems = list(itertools.islice(task.train_problems(cfg.train.seed), 50_000))
    by_prompt = {p.prompt: p for p in problems}
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems]})
    new_tokens = cfg.generator.max_new_tokens

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [score_completion(by_prompt[p], c) for p, c in zip(prompts, completions)]

    curve: list[dict[str, float]] = []
    per_step = cfg.train.batch_size * cfg.train.group_size  # samples generated and trained per step

    class Clock(TrainerCallback):
        """Training time without evaluations; evaluates and stops on it."""

        def __init__(self) -> None:
            self.train_s, self.last, self.next_eval = 0.0, time.perf_counter(), 1.0
            self.eval_cpu_s = 0.0  # CPU time of the evaluations, left out of TRL's training CPU time

        def _eval(self, step: int) -> None:
            cpu0 = time.process_time()
            acc = greedy_accuracy(model, tokenizer, heldout, new_tokens)
            self.eval_cpu_s += time.process_time() - cpu0
            curve.append({"time_s": self.train_s, "step": step, "samples": step * per_step, "accuracy": acc})
            print(f"  TRL  {self.train_s:6.0f}s step {step:5d} held-out {acc:.3f}", flush=True)

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self.train_s += time.perf_counter() - self.last
            if self.train_s >= self.next_eval or self.train_s >= budget_s:
                self._eval(state.global_step)  # densely at first, where the curve rises: every quarter of the
                self.next_eval = self.train_s + max(1.0, min(eval_every_s, self.train_s / 4))  # time so far
            if self.train_s >= budget_s:
                control.should_training_stop = True
            self.last = time.perf_counter()

    clock = Clock()
    args = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=cfg.train.batch_size * cfg.train.group_size,
        num_generations=cfg.train.group_size, max_completion_length=new_tokens, learning_rate=cfg.train.lr,
        lr_scheduler_type="constant", beta=0.0, temperature=cfg.generator.temperature, bf16=False, use_cpu=True,
        gradient_checkpointing=False, max_steps=10**7, logging_steps=10**9, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=cfg.train.seed, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock])
    curve.append({"time_s": 0.0, "step": 0, "samples": 0,
                  "accuracy": greedy_accuracy(model, tokenizer, heldout, new_tokens)})
    clock.last = time.perf_counter()
    cpu0 = time.process_time()
    trainer.train()
    cpu_s = time.process_time() - cpu0 - clock.eval_cpu_s
    steps = curve[-1]["step"]
    samples = steps * per_step
    return {"curve": curve, "time_s": clock.train_s, "steps": steps, "samples_per_s": samples / clock.train_s,
            "accuracy_end": curve[-1]["accuracy"],
            "cpu": {"cpu_s": cpu_s, "time_s": clock.train_s, "samples": samples, "generated_samples": samples,
                    "by_process": {"trl": cpu_s}}}


# -- async_rlhf ----------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def default_generators() -> int:
    """One generator per two cores beside the learner's: on 2 cores, 1. A second generator there can only borrow
    the learner's core, and costs more than it brings (measured on addition3: 7.8-8.7 learner steps/s with 2 at
    nice +10 to +19 against 9.4 with 1; the learner's forward/backward 82-88 ms against 62)."""
    from async_rlhf.driver.cpu_plan import available_cores

    return max(1, (len(available_cores()) - 1) // 2)


def run_ours(cfg_args: list[str], group_size: int, model_dir: str, budget_s: float, eval_every: int,
             work: Path, generators: int, ours_set: tuple[str, ...] = ()) -> dict[str, Any]:
    from async_rlhf.driver.control import send_control

    run_dir = work / "ours"
    # one engine holds what two would: its steps carry twice the sequences (cheaper per sample)
    in_flight = max(8, 16 // generators)
    args = [sys.executable, str(ROOT / "launch" / "cluster.py"), "--generators", str(generators), "--learners", "1",
            *cfg_args, f"generator.groups_in_flight={in_flight}",
            "train.steps=10000000", f"generator.eval_every={eval_every}", "run.log_every_s=15",
            f"model.path={model_dir}", f"run.dir={run_dir}", *ours_set]  # last: the user's settings win
    log = (work / "ours.log").open("w")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        first = None
        while first is None:
            if proc.poll() is not None:
                raise RuntimeError(f"async_rlhf exited before its first step; see {work / 'ours.log'}")
            steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step" in r]
            first = steps[0]["time"] if steps else None
            time.sleep(0.5)
        sampler, cpu_from = ProcessCpu(proc.pid), time.time()  # start-up is not counted, as for the clock
        sampler.begin()
        sampled = cpu_from
        while time.time() - first < budget_s and proc.poll() is None:
            time.sleep(0.5)
            if time.time() - sampled >= SAMPLE_EVERY_S:
                sampler.sample()
                sampled = time.time()
        window, cpu_until = sampler.end(), time.time()
        send_control(run_dir, {"op": "stop"})
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "step" in r and r.get("kind") != "eval"]
    summary = json.loads((run_dir / "summary.json").read_text())
    at_version = {int(r["version"]): r["time"] - first for r in steps}
    samples_at, trained = {}, 0  # samples trained up to and including the step that made each version
    for r in steps:
        trained += r.get("rollout/samples", 0)
        samples_at[int(r["version"])] = trained
    curve = [{"time_s": 0.0, "step": 0, "samples": 0, "accuracy": summary["accuracy_start"]}]
    curve += [{"time_s": at_version[v], "step": v, "samples": samples_at[v], "accuracy": r["eval/heldout_accuracy"]}
              for r in records if r.get("kind") == "eval" and (v := int(r["version"])) in at_version]
    span = steps[-1]["time"] - first
    curve.append({"time_s": span, "step": steps[-1]["step"], "samples": trained, "accuracy": summary["accuracy_end"]})
    put = steps[-1].get("buffer/put", 0) * group_size  # groups put -> samples generated
    in_window = [r for r in steps if cpu_from < r["time"] <= cpu_until]  # the steps the CPU reading covers
    return {"curve": curve, "time_s": span, "steps": steps[-1]["step"], "accuracy_end": summary["accuracy_end"],
            "samples_per_s": sum(r["rollout/samples"] for r in steps[1:]) / max(span, 1e-9),
            "generated_samples_per_s": put / max(span, 1e-9),
            "cpu": {"cpu_s": sum(window["by_process"].values()), "time_s": cpu_until - cpu_from, **window,
                    "samples": sum(r["rollout/samples"] for r in in_window),
                    "generated_samples": group_size * (in_window[-1].get("buffer/put", 0) - in_window[0].get(
                        "buffer/put", 0)) if in_window else 0},
            "learner_push_wait_fraction": summary.get("learner_push_wait_fraction"),
            "learner_compute_fraction": summary.get("learner_compute_fraction"),
            "zero_advantage_share": steps[-1].get("buffer/dropped_zero_advantage", 0) / max(1, steps[-1].get(
                "buffer/put", 0))}


# -- comparison ----------------------------------------------------------------------------------------
def compare(task: str, budget_s: float, eval_every_s: float, out_dir: Path, model: str = "",
            generators: int = 1, ours_set: tuple[str, ...] = (), seeds: int = 1, vary_start: bool = False,
            target: float | None = None) -> dict[str, Any]:
    """Both sides on ``task`` for seeds 0..seeds-1, interleaved (TRL seed 0, ours seed 0, TRL seed 1, ...)."""
    target = TARGETS[task] if target is None else target
    group_size = task_config(task, ours_set).train.group_size  # our samples per group, under --ours-set
    shared = str(Path(model).resolve()) if model else None
    if shared is None and not vary_start:
        shared = start_policy(task_config(task))  # seed 0's warm start for every seed
    # our evaluations run on generator 0 inside our clock (200 greedy prompts, ~0.2 s of its time), so every
    # 40 versions (~4 s of training); every 10 took about a sixth of the one generator's time on addition
    eval_every = {"longtail": 5}.get(task, 40)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=f"vs_trl_{task}_") as tmp:
        for seed in range(seeds):
            cfg = task_config(task, seed=seed)  # TRL's run: --ours-set never reaches it
            model_dir = shared or start_policy(cfg)
            work = Path(tmp) / f"seed{seed}"
            work.mkdir()
            of = f", seed {seed} (seeds 0-{seeds - 1})" if seeds > 1 else ""
            print(f"[{task}] TRL GRPOTrainer, {budget_s:.0f} s of training{of}", flush=True)
            trl = run_trl(cfg, model_dir, budget_s, eval_every_s, work)
            print(f"[{task}] async_rlhf, {budget_s:.0f} s from its first step{of}", flush=True)
            ours = run_ours(seeded(task, seed), group_size, model_dir, budget_s, eval_every, work, generators,
                            ours_set)
            log = f"{task}_ours.log" if seeds == 1 else f"{task}_seed{seed}_ours.log"
            (out_dir / log).write_text((work / "ours.log").read_text())
            rows.append(pair_row(task, seed, trl, ours, generators, ours_set, model_dir))
            if seeds > 1:
                print(seed_line(rows[-1], target), flush=True)
    if seeds == 1:
        plot(task, {"curve": rows[0]["trl_curve"]}, {"curve": rows[0]["ours_curve"]}, out_dir / f"{task}_curves.png",
             generators)
    plot_seeds(task, rows, out_dir / f"{task}_seeds.png", generators, target)
    return task_entry(rows, target, vary_start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=None, help="RL training time per side and task (600)")
    p.add_argument("--quick", action="store_true", help="150 s per side and task (unless --budget-s says)")
    p.add_argument("--model", default="", help="start both sides from this Hugging Face directory instead of "
                   "the tiny policy's SFT warm start for the task (built and cached in runs/cache)")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset of " + ",".join(TASKS))
    p.add_argument("--eval-every-s", type=float, default=0.0, help="longest TRL evaluation interval (default "
                   "budget/60: its clock stops while it evaluates, and ours evaluates every few seconds)")
    p.add_argument("--generators", type=int, default=0, help="async_rlhf's generators (default: one per two cores "
                   "beside the learner's, at least 1)")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of async_rlhf's run only, after the shared ones (repeatable), e.g. "
                   "generator.groups_in_flight=24: what-if runs against the same TRL baseline")
    p.add_argument("--seeds", type=int, default=1, help="runs per side and task, with train.seed=0..K-1 on both "
                   "sides, interleaved (TRL seed 0, ours seed 0, TRL seed 1, ...); all from seed 0's warm start")
    p.add_argument("--vary-start", action="store_true", help="with --seeds: each seed from its own warm start "
                   "(train.seed=S's, built and cached in runs/cache on first use) instead of seed 0's")
    p.add_argument("--target", action="append", default=[], metavar="ACC|TASK=ACC[,TASK=ACC]",
                   help="the accuracy whose time the seeds are compared on, for every task or per task (default "
                   + ", ".join(f"{t}={a}" for t, a in TARGETS.items()) + ")")
    p.add_argument("--out", default="runs/vs_trl/results.json")
    args = p.parse_args()
    budget = args.budget_s or (150.0 if args.quick else 600.0)
    tasks = args.tasks.split(",")
    if args.seeds < 1:
        p.error("--seeds: at least 1")
    try:
        targets = parse_targets(args.target, [t for t in tasks if t in TASKS])
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    machine, commit = machine_record(), git_commit()
    print(describe(machine, commit), flush=True)

    target, target_line = target_for(budget)
    if args.seeds > 1:
        target_line += f" (over {args.seeds} seeds: the mean of the seeds' ratios)"

    def result() -> dict[str, Any]:
        holds = bool(rows) and all(task_ratio(r) <= target for r in rows)
        return stamp({"budget_s": budget, "target": target_line, "holds": holds, "samples_note": SAMPLES_NOTE,
                      "seeds": args.seeds, "vary_start": args.vary_start, "targets": targets, "spread": STD_NOTE,
                      "tasks": rows}, machine, commit)

    for task in tasks:  # every task and --ours-set checked before the first run
        if task not in TASKS:
            p.error(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        try:
            task_config(task, tuple(args.ours_set))
        except ValueError as exc:
            p.error(f"--ours-set: {exc}")
    for task in tasks:
        rows.append(compare(task, budget, args.eval_every_s or budget / 60, out.parent, args.model,
                            args.generators or default_generators(), tuple(args.ours_set), args.seeds,
                            args.vary_start, targets[task]))
        if args.seeds == 1:
            report(rows[-1])
        report_seeds(rows[-1])
        out.write_text(json.dumps(result(), indent=2))
    finish(machine)
    final = result()
    out.write_text(json.dumps(final, indent=2))
    print(f"\ntarget: {target_line}: {'holds' if final['holds'] else 'MISSED'}")
    print(describe(machine, commit))
    print(f"written {out} and the curves beside it")


if __name__ == "__main__":
    main()
