"""Launch an asynchronous RL run.

    python launch/cluster.py --generators 2 --learners 1 [--config run.yaml] [--model DIR]
                             [--address ray://host:10001] [--resume RUN_DIR|CHECKPOINT] [--dry-run]
                             [key=value ...]
    python launch/cluster.py scale --run-dir runs/demo --generators 4     (a running job's fleet)
    python launch/cluster.py stop --run-dir runs/demo      (end a running job early: checkpoint + summary)

Ctrl-C (SIGINT) or SIGTERM does what ``stop`` does: the learners finish their step, a final checkpoint and
summary.json (with the steps actually done) are written; a second signal aborts at once. A run directory
that already holds a run is refused unless ``--resume`` continues it or ``run.overwrite=true`` replaces it.

Everything is validated before anything starts: a bad flag, config key, file, model path, checkpoint,
unreachable --address or a plan larger than the cluster is refused with one line naming the problem and
the fix. ``--dry-run`` validates and prints the placement plan (resources per role, totals) without Ray.
Under ``ray job submit``, leave out --address: the job joins its cluster (RAY_ADDRESS) itself.
``--dry-run --address A`` also prints where each role's bundles would go, node by node.

This file is the plan stage of a start-up (config, placement, memory, address, fits: nothing started);
``async_rlhf/driver/cluster.py`` draws the stages that follow (provision, start, watch).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generators", type=int, help="generator actors (vLLM engines); default from config")
    p.add_argument("--learners", type=int, help="learner ranks (DeepSpeed engines); default from config")
    p.add_argument("--config", help="YAML file of config sections (see async_rlhf/config/sections.py and roles.py)")
    p.add_argument("--model", help="Hugging Face causal-LM directory; default: the tiny model + SFT warm start")
    p.add_argument("--address", help="Ray cluster to join (default: start Ray on this machine)")
    p.add_argument("--run-dir", help="run directory (default runs/demo)")
    p.add_argument("--resume", help="continue from a run directory's last checkpoint or a checkpoints/step-N dir")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config and print the placement plan; start nothing")
    p.add_argument("overrides", nargs="*", help="config overrides such as train.steps=100")
    return p.parse_intermixed_args(argv)  # overrides may come before, between and after the flags


def parse_scale_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cluster.py scale", description="resize the generator fleet of a running job")
    p.add_argument("--run-dir", required=True, help="run directory of the running job (holds control.json)")
    p.add_argument("--generators", type=int, required=True, help="generators wanted")
    return p.parse_args(argv)


def parse_stop_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cluster.py stop",
                                description="end a running job early, with a final checkpoint and summary")
    p.add_argument("--run-dir", required=True, help="run directory of the running job (holds control.json)")
    return p.parse_args(argv)


def check_address(address: str, timeout_s: float = 3.0) -> None:
    """Refuse an ``--address`` nothing listens on (``auto`` is left to Ray)."""
    import socket

    if address == "auto":
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise _config_error(f"--address {address}: expected host:port or ray://host:port (or auto)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise _config_error(f"--address {address} is unreachable ({exc.strerror or exc}); check that the Ray "
                            "head runs there and the port is open, or leave --address out to start Ray here"
                            ) from None


def _config_error(msg: str) -> Exception:
    from async_rlhf.config import ConfigError

    return ConfigError(msg)


def local_resources(cfg) -> dict[str, float]:
    """What a Ray started on this machine offers: GPUs found by nvidia-smi; CPUs only when run.num_cpus
    caps them (otherwise roles share the cores and the plan's CPUs are a reservation, not a limit)."""
    import shutil
    import subprocess

    gpus = 0
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
        gpus = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    cpus = cfg.run.num_cpus or float("inf")
    return {"CPU": cpus, "GPU": float(gpus), "_cores": float(os.cpu_count() or 1)}


def node_memory_gb() -> float:
    """This machine's memory (all of it: what else runs now may change, the fleet's need does not)."""
    import psutil

    return psutil.virtual_memory().total / 1e9


def build_config(args: argparse.Namespace):
    from async_rlhf.config import check_model_dir, load_config

    overrides = list(args.overrides)
    if args.generators is not None:
        overrides.append(f"generators={args.generators}")
    if args.learners is not None:
        overrides.append(f"learners={args.learners}")
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.run_dir:
        overrides.append(f"run.dir={args.run_dir}")
    base = args.config
    if args.resume:
        from async_rlhf.driver.checkpoints import read_manifest, resolve_resume, run_dir_of

        args.checkpoint = resolve_resume(args.resume)
        run_dir = run_dir_of(args.checkpoint)
        if not args.config and (run_dir / "config.json").is_file():
            base = str(run_dir / "config.json")  # the run's own config; overrides still apply
        if not args.run_dir:
            overrides.append(f"run.dir={run_dir}")
    cfg = load_config(base, overrides)
    from async_rlhf.driver.checkpoints import check_run_dir
    from async_rlhf.driver.run_lock import refuse_if_live

    refuse_if_live(cfg.run.dir)  # a live run is named first (a repeated command must not be told to overwrite it)
    check_run_dir(cfg.run.dir, bool(args.resume), cfg.run.overwrite)
    if args.resume:
        from async_rlhf.driver.progress import check_learners

        manifest = read_manifest(args.checkpoint)
        check_learners(manifest, cfg, args.checkpoint)  # before anything starts, not once the ranks are up
        step = manifest["step"]
        if cfg.train.steps <= step:
            raise _config_error(f"--resume {args.resume}: the checkpoint is at step {step} and train.steps is "
                                f"{cfg.train.steps}; raise train.steps to continue")
    if cfg.model.path:
        check_model_dir(cfg.model.path)
    from async_rlhf.prompts.chat import ChatPromptError, check_chat_setup

    try:  # chat messages the model's tokenizer cannot render are refused before anything starts
        check_chat_setup(cfg, cfg.model.path or None)
    except ChatPromptError as exc:
        raise _config_error(str(exc)) from None
    return cfg


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from async_rlhf.config import ConfigError

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["scale"]:
        return scale(parse_scale_args(argv[1:]))
    if argv[:1] == ["stop"]:
        return stop(parse_stop_args(argv[1:]))
    args = parse_args(argv)
    args.checkpoint = None
    try:
        cfg = build_config(args)
        from async_rlhf.driver.placement import check_fits, format_plan, plan_placement

        plan = plan_placement(cfg)
        from async_rlhf.driver.role_env import joined_address

        args.address = joined_address(args.address)  # `ray job submit` sets RAY_ADDRESS
        if args.address:
            check_address(args.address)
        from async_rlhf.driver.memory_plan import check_memory, plan_for

        memory = plan_for(cfg)  # host memory per role: a fleet this machine cannot hold is refused here
        if args.dry_run:  # the window and completion length the run will use (a --model's own: config/model_limits.py)
            from async_rlhf.config import model_limits_line

            print(model_limits_line(cfg))
        if args.dry_run and not args.address:
            from async_rlhf.driver.placement import local_ray_cpus

            here = local_resources(cfg)  # Ray's logical CPUs: what the plan needs, or run.num_cpus (checked as a run)
            cores = int(here["_cores"])
            ray_cpus = local_ray_cpus(cfg, plan, cores)
            print(format_plan(plan, {"CPU": ray_cpus, "GPU": here["GPU"]}, "this machine's Ray",
                              cores=cores, ray_cpus=ray_cpus))
            print(memory.table())
            try:
                check_memory(memory, node_memory_gb())
                print(f"fits this machine's memory ({node_memory_gb():.1f} GB): yes")
            except ConfigError as exc:
                print(f"fits this machine's memory: no, {exc}")
            print("plan (JSON): " + json.dumps({**plan.to_dict(), "memory": memory.to_dict()}))
            return 0
        if not args.address:
            check_fits(plan, local_resources(cfg), "this machine")
            check_memory(memory, node_memory_gb())
        else:
            import ray

            from async_rlhf.run_logs import forward_role_output, is_verbose

            # joining: nothing but the address (Ray refuses resource arguments), whether roles print here, and
            # Ray's warnings only (its "Connecting to existing Ray cluster" would precede the run's first line)
            ray.init(address=args.address, log_to_driver=forward_role_output(cfg),
                     logging_level=logging.INFO if is_verbose(cfg) else logging.WARNING)
            check_fits(plan, ray.cluster_resources(), f"the Ray cluster at {args.address}")
            if args.dry_run:
                from async_rlhf.driver.placement import assign_to_nodes, format_nodes

                nodes = {n["NodeManagerAddress"]: {k: float(v) for k, v in n["Resources"].items()}
                         for n in ray.nodes() if n.get("Alive")}
                print(format_plan(plan, ray.cluster_resources(), f"the Ray cluster at {args.address}"))
                print(format_nodes(assign_to_nodes(plan, nodes)))
                memory = plan_for(cfg, nodes=len(nodes))  # each node pays its own Ray and fork server
                print(memory.table())
                print("plan (JSON): " + json.dumps({**plan.to_dict(), "memory": memory.to_dict()}))
                return 0
        from async_rlhf.driver.run_lock import hold_run_dir

        lock = hold_run_dir(cfg.run.dir)  # one driver per run directory: a second is refused here, naming the first
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from async_rlhf.driver.runner import run

    try:
        run(cfg, address=args.address, resume=args.checkpoint, stop=stop_on_signals(), lock=lock, console=True)
    except Exception as exc:  # a role failed mid-run: the job has stopped its actors; say how to go on
        from async_rlhf.driver.checkpoints import list_checkpoints
        from async_rlhf.driver.fleet import RunFailure
        from async_rlhf.driver.provision import NodeSetupError
        from async_rlhf.driver.runner import LearnerFailure
        from async_rlhf.run_logs import console_stderr

        trace = Path(cfg.run.dir) / "error.log"  # the whole traceback, for whoever debugs it
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(traceback.format_exc())
        if not isinstance(exc, (ConfigError, LearnerFailure, NodeSetupError, RunFailure)):  # the line below says it
            logging.getLogger("launch").exception("the run failed")
        done = list_checkpoints(cfg.run.dir)
        hint = f"resume with --resume {done[-1]}" if done else "no checkpoint was written (run.checkpoint_every)"
        print(f"error: the run stopped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
              f"{hint} (traceback in {trace})", file=console_stderr())
        return 1
    return 0


def stop_on_signals():
    """An event the first SIGINT or SIGTERM sets: the run then stops after the learners' current step, with a
    checkpoint and summary (``async_rlhf.driver.stopping.catch_stop_signals``); a second signal aborts at once."""
    import threading

    from async_rlhf.driver.stopping import catch_stop_signals

    event = threading.Event()
    catch_stop_signals(event)
    return event


def _control(run_dir: str, msg: dict) -> dict | None:
    """Send ``msg`` to the running job's control endpoint; None after printing one ``error:`` line."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from async_rlhf.driver.control import send_control

    try:
        reply = send_control(run_dir, msg)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if not reply.get("ok"):
        print(f"error: {reply.get('error')}", file=sys.stderr)
        return None
    return reply


def stop(args: argparse.Namespace) -> int:
    reply = _control(args.run_dir, {"op": "stop"})
    if reply is None:
        return 2
    print(f"{args.run_dir}: stopping ({reply['applied_at']})")
    return 0


def scale(args: argparse.Namespace) -> int:
    if args.generators < 1:
        print(f"error: --generators must be at least 1, got {args.generators}", file=sys.stderr)
        return 2
    reply = _control(args.run_dir, {"op": "scale", "generators": args.generators})
    if reply is None:
        return 2
    print(f"fleet of {args.run_dir}: scaling to {args.generators} generator(s) ({reply['applied_at']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
