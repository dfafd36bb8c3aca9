"""Pipeline efficiency: does the asynchronous pipeline keep its slower role saturated?

In one Ray session, for each task variant (``tiny``: 2-digit addition, answers of 4 tokens; ``longtail``:
answers of 1-40 tokens, heavy-tailed, see ``async_rlhf/env/longtail.py``):

    1 standalone   one cluster, the pipeline's CPU plan (each role pinned to its own cores and threads)
                   a) generators alone: they stream into the buffer, a drain consumer acks (no learner)
                      -> generator capacity, samples/s
                   b) learner alone: generation stopped, the learner trains on the groups the generators
                      left in the buffer (same shapes), still pushing weights every step
                      -> learner capacity, samples/s
                   (max_staleness is huge here, so admission never binds and no group is too stale)
    2 async        the pipeline: same cores, train.max_staleness as configured  -> samples/s trained
    3 sync         train.max_staleness=0 in its best configuration, all of a batch in flight at once: every
                   role on every core with as many threads as cores (a colocated synchronous trainer), and
                   (not with --quick) the pipeline's core split; the faster one counts

    efficiency     = async samples/s / min(generator capacity, learner capacity)   (same run, same cores)
    async_over_sync = async samples/s / sync samples/s

Rates are steady-state: trained samples between the end of step k (k = a fifth of the steps, at least 2)
and the last step, over that time. Generator busy fraction = share of that window spent generating or
rewarding/putting. Held-out greedy accuracy every ``generator.eval_every`` versions gives accuracy against
samples trained for async and sync (the same for both, one version per step).

    python bench/pipeline.py [--quick] [--out runs/pipeline/results.json] [--variants tiny,longtail] [key=value ...]
    python bench/pipeline.py --standalone-only --variants longtail learner.pack=true   # capacities only

Writes ``--out`` (JSON: efficiency_tiny, efficiency_longtail, generator_busy_fraction,
async_over_sync_longtail, the standalone capacities, per-variant details), ``table.md``,
``accuracy.png`` and each run's ``timeline.png`` / ``timeline.json`` / ``cpu_plan.json`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "tiny": ["task.name=addition", "generator.max_new_tokens=6"],
    "longtail": ["task.name=longtail", "generator.max_new_tokens=41"],
}
PIPELINE = ["generators=1", "learners=1", "train.batch_size=16", "train.group_size=8",
            "generator.groups_in_flight=16", "run.log_every_s=30"]
HUGE_STALENESS = 1_000_000


def steady_rate(records: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(samples/s, window start, window end) over the steps after the first fifth (at least 2 skipped)."""
    k = max(2, len(records) // 5)
    if len(records) <= k:
        raise RuntimeError(f"only {len(records)} learner steps: need more than {k} for a steady-state rate "
                           "(raise --steps)")
    start, end = records[k - 1]["time"], records[-1]["time"]
    return sum(r["rollout/samples"] for r in records[k:]) / (end - start), start, end


def drain(cfg: Any, address: str, stop: threading.Event, counts: dict[str, int]) -> None:
    """Consume and ack everything the generators put (the learner's buffer traffic, without training)."""
    from async_rlhf.buffer.build import make_client

    client = make_client(cfg, address, consumer="bench-drain")
    try:
        while not stop.is_set():
            groups = client.get(cfg.train.batch_size, 0, wait_s=0.2)
            if groups:
                client.ack([g.group_id for g in groups])
                counts["groups"] += len(groups)
    finally:
        client.close()


def _affinity(_actor: Any) -> list[int]:
    return sorted(os.sched_getaffinity(0))


def measured_affinity(cluster: Any) -> dict[str, list[int]]:
    """The cores each actor's process may actually run on (what the CPU plan pinned)."""
    import ray

    actors = {"buffer": cluster.buffer, **{f"generator {i}": g for i, g in enumerate(cluster.generators)},
              **{f"learner {r}": lr for r, lr in enumerate(cluster.learners)}}
    return dict(zip(actors, ray.get([a.__ray_call__.remote(_affinity) for a in actors.values()])))


def _set_groups_in_flight(actor: Any, n: int) -> None:
    """Runs inside a generator (``__ray_call__``): the loop reads this every iteration; 0 stops admitting
    while the loop keeps answering weight pushes."""
    actor.cfg.generator.groups_in_flight = n


def standalone(overrides: list[str], model_path: str, run_dir: Path, window_s: float,
               learner_steps: int) -> dict[str, Any]:
    import ray

    from async_rlhf.buffer.build import make_client
    from async_rlhf.config import load_config
    from async_rlhf.driver.cluster import Cluster

    cfg = load_config(None, [*overrides, f"train.max_staleness={HUGE_STALENESS}", f"model.path={model_path}",
                             f"run.dir={run_dir}", "buffer.capacity=8192", f"train.steps={learner_steps}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(cfg, model_path)
    (run_dir / "cpu_plan.json").write_text(json.dumps(cluster.cpu_plan.to_dict(), indent=2))
    affinity = measured_affinity(cluster)
    client = make_client(cfg, cluster.buffer_address, consumer="bench")
    stop, counts = threading.Event(), {"groups": 0}
    drainer = threading.Thread(target=drain, args=(cfg, cluster.buffer_address, stop, counts), daemon=True)
    try:
        runs = [g.run.remote() for g in cluster.generators]
        drainer.start()

        def produced() -> float:
            stats = ray.get([g.stats.remote() for g in cluster.generators], timeout=120)  # never hang silently
            return float(sum(s["samples"] for s in stats))

        deadline = time.time() + 120
        while produced() == 0 and time.time() < deadline:  # vLLM's first batches are slow: skip them
            time.sleep(0.5)
        time.sleep(min(5.0, window_s / 3))
        s0, t0 = produced(), time.time()
        time.sleep(window_s)
        s1, t1 = produced(), time.time()
        print(f"   generators alone: {s1 - s0:.0f} samples in {t1 - t0:.1f}s", flush=True)
        stop.set()
        drainer.join()
        need = learner_steps * cfg.train.batch_size
        deadline = time.time() + 300
        while client.stats()["buffer/depth"] < need:
            if time.time() > deadline:
                raise RuntimeError(f"generators did not leave {need} groups for the learner within 300 s")
            time.sleep(0.5)
        ray.get([g.__ray_call__.remote(_set_groups_in_flight, 0) for g in cluster.generators])
        ray.get([lr.train.remote(learner_steps) for lr in cluster.learners])
        records = ray.get(cluster.learners[0].metrics_since.remote(0))
        for g in cluster.generators:
            g.stop.remote()
        ray.get(runs)
    finally:
        stop.set()
        client.close()
        cluster.close()
    learner_rate = steady_rate(records)[0]
    fb = sorted(r.get("time/forward_backward_s", 0.0) for r in records[max(2, len(records) // 5):])
    return {"generator_samples_per_s": (s1 - s0) / (t1 - t0), "learner_samples_per_s": learner_rate,
            "learner_forward_backward_s_median": fb[len(fb) // 2] if fb else 0.0,
            "load_average_after": os.getloadavg()[0],
            "learner_steps": len(records), "drained_groups": counts["groups"],
            "cpu_plan": cluster.cpu_plan.to_dict(), "affinity": affinity}


def pipeline(overrides: list[str], model_path: str, run_dir: Path, steps: int, staleness: int) -> dict[str, Any]:

    from async_rlhf.config import load_config
    from async_rlhf.driver.cluster import Cluster, heldout_accuracy
    from async_rlhf.driver.runner import train, write_timeline
    from async_rlhf.plots import BUSY
    from async_rlhf.timeline import busy_fraction_between

    cfg = load_config(None, [*overrides, f"train.max_staleness={staleness}", f"train.steps={steps}",
                             f"model.path={model_path}", f"run.dir={run_dir}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(cfg, model_path)
    (run_dir / "cpu_plan.json").write_text(json.dumps(cluster.cpu_plan.to_dict(), indent=2))
    try:
        figures = train(cfg, cluster, run_dir)
        policy = cluster.save_policy(run_dir / "policy")
    finally:
        cluster.close()
    busy = write_timeline(figures, run_dir)
    records = figures["records"]
    rate, start, end = steady_rate(records)
    gen_busy = [busy_fraction_between(tl["intervals"], BUSY["generator"], start, end)
                for tl in figures["timelines"] if str(tl["role"]).startswith("generator")]
    per_step = cfg.train.batch_size * cfg.train.group_size  # samples trained per version (push_every=1)
    return {
        "samples_per_s": rate,
        "generator_busy_fraction": sum(gen_busy) / len(gen_busy),
        "whole_run_busy": busy,
        "final_accuracy": heldout_accuracy(policy, cfg),
        "curve": [[e["version"] * per_step, e["accuracy"]] for e in figures["evals"]],
        "mean_staleness": sum(r["staleness/mean"] for r in records) / len(records),
        "wall_time_s": figures["wall_time_s"],
        "timeline_png": str(run_dir / "timeline.png"),
        "load_average_after": os.getloadavg()[0],
    }


def run_variant(name: str, args: argparse.Namespace, out_dir: Path, common: list[str]) -> dict[str, Any]:
    from async_rlhf.config import load_config
    from async_rlhf.driver.cluster import heldout_accuracy, resolve_model

    base = [*PIPELINE, *VARIANTS[name], *common]
    cfg = load_config(None, base)
    model_path = resolve_model(cfg, ROOT / "runs" / "cache")
    start_acc = heldout_accuracy(model_path, cfg)
    steps = args.steps or (40 if args.quick else 150)
    print(f"== {name}: policy {model_path}, held-out greedy accuracy {start_acc:.3f} before RL", flush=True)
    alone = standalone(base, model_path, out_dir / f"{name}_standalone", 12.0 if args.quick else 30.0,
                       12 if args.quick else 30)
    print(f"   standalone: generators {alone['generator_samples_per_s']:.1f} samples/s, learner "
          f"{alone['learner_samples_per_s']:.1f} samples/s", flush=True)
    if args.standalone_only:
        return {"start_accuracy": start_acc, "standalone": alone}
    asyn = pipeline(base, model_path, out_dir / f"{name}_async", steps, cfg.train.max_staleness)
    print(f"   async: {asyn['samples_per_s']:.1f} samples/s, generator busy {asyn['generator_busy_fraction']:.2f}, "
          f"final accuracy {asyn['final_accuracy']:.3f}", flush=True)
    cores = len(os.sched_getaffinity(0))
    whole = [f"generator.groups_in_flight={cfg.train.batch_size}"]  # a whole batch in flight at once
    sync_configs = {"all_cores": [*base, "generator.cpus=all", "learner.cpus=all", "buffer.cpus=all",
                                  f"generator.threads={cores}", f"learner.threads={cores}", *whole]}
    if not args.quick:  # the pipeline's own core split, in case the roles' thread pools get in each other's way
        sync_configs["split_cores"] = [*base, *whole]
    syncs = {}
    for label, overrides in sync_configs.items():
        syncs[label] = pipeline(overrides, model_path, out_dir / f"{name}_sync_{label}", steps, 0)
        print(f"   sync ({label}): {syncs[label]['samples_per_s']:.1f} samples/s, final accuracy "
              f"{syncs[label]['final_accuracy']:.3f}", flush=True)
    best = max(syncs, key=lambda k: syncs[k]["samples_per_s"])
    sync = {**syncs[best], "config": best, "all_configs": {k: v["samples_per_s"] for k, v in syncs.items()}}
    bound = min(alone["generator_samples_per_s"], alone["learner_samples_per_s"])
    return {
        "start_accuracy": start_acc,
        "standalone": alone,
        "async": asyn,
        "sync": sync,
        "bound_samples_per_s": bound,
        "bottleneck": "generator" if alone["generator_samples_per_s"] <= alone["learner_samples_per_s"] else "learner",
        "efficiency": asyn["samples_per_s"] / bound,
        "async_over_sync": asyn["samples_per_s"] / sync["samples_per_s"],
    }


def summarize(results: dict[str, dict[str, Any]], load: str) -> dict[str, Any]:
    out: dict[str, Any] = {"load_average": load, "cores": sorted(os.sched_getaffinity(0)), "variants": results}
    for name, r in results.items():
        out[f"efficiency_{name}"] = r["efficiency"]
        out[f"async_over_sync_{name}"] = r["async_over_sync"]
        out[f"standalone_generator_samples_per_s_{name}"] = r["standalone"]["generator_samples_per_s"]
        out[f"standalone_learner_samples_per_s_{name}"] = r["standalone"]["learner_samples_per_s"]
    gen_bound = [r for r in results.values() if r["bottleneck"] == "generator"] or list(results.values())
    out["generator_busy_fraction"] = min(r["async"]["generator_busy_fraction"] for r in gen_bound)
    return out


def table(results: dict[str, dict[str, Any]], load: str) -> str:
    lines = [f"load average during the run: {load}", "",
             "| variant | gen alone | learner alone | bound | async | efficiency | gen busy | sync | async/sync | "
             "acc start | acc async | acc sync |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        a, s = r["async"], r["sync"]
        lines.append(
            f"| {name} | {r['standalone']['generator_samples_per_s']:.1f} | "
            f"{r['standalone']['learner_samples_per_s']:.1f} | {r['bound_samples_per_s']:.1f} ({r['bottleneck']}) | "
            f"{a['samples_per_s']:.1f} | {r['efficiency']:.2f} | {a['generator_busy_fraction']:.2f} | "
            f"{s['samples_per_s']:.1f} | {r['async_over_sync']:.2f} | {r['start_accuracy']:.3f} | "
            f"{a['final_accuracy']:.3f} | {s['final_accuracy']:.3f} |")
    return "\n".join(lines) + "\n\nrates in trained (or, for gen alone, generated) samples/s\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and shorter standalone windows")
    p.add_argument("--steps", type=int, help="learner steps of the async and sync runs")
    p.add_argument("--variants", default="tiny,longtail", help="comma-separated subset of tiny,longtail")
    p.add_argument("--out", default="runs/pipeline/results.json")
    p.add_argument("--standalone-only", action="store_true",
                   help="measure only the standalone capacities (generators alone, learner alone), e.g. to compare "
                        "learner.pack=false with learner.pack=true learner.max_tokens_per_micro_batch=1024")
    p.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = p.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    out = Path(args.out)
    out_dir = out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    common = [f"generator.eval_every={10 if args.quick else 25}", *args.overrides]
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            results[name] = run_variant(name, args, out_dir, common)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.standalone_only:  # the capacities only (e.g. learner.pack=false against true: bench/README in docs)
        summary = {"load_average": load, "overrides": args.overrides, "variants": results, **{
            f"standalone_{role}_samples_per_s_{n}": r["standalone"][f"{role}_samples_per_s"]
            for n, r in results.items() for role in ("generator", "learner")}}
        out.write_text(json.dumps(summary, indent=2))
        print(json.dumps({k: v for k, v in summary.items() if k != "variants"}, indent=2))
        return
    summary = summarize(results, load)
    out.write_text(json.dumps(summary, indent=2))
    text = table(results, load)
    (out_dir / "table.md").write_text(text)
    from async_rlhf.plots import plot_accuracy_per_sample

    curves = {f"{n} {mode}": r[mode]["curve"] for n, r in results.items() for mode in ("async", "sync")}
    plot_accuracy_per_sample(curves, out_dir / "accuracy.png")
    print(text)
    print(json.dumps({k: v for k, v in summary.items() if k != "variants"}, indent=2))
    print(f"wrote {out}, {out_dir / 'table.md'}, {out_dir / 'accuracy.png'}; timelines: "
          + ", ".join(r["async"]["timeline_png"] for r in results.values()))


if __name__ == "__main__":
    main()
