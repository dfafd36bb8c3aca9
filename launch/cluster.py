"""Launch an asynchronous RL run.

    python launch/cluster.py --generators 2 --learners 1 [--config run.yaml] [--model DIR]
                             [--address ray://host:10001] [key=value ...]

Everything is validated before anything starts: a bad flag, config key, file or model path is refused
with one line naming the problem and the fix.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generators", type=int, help="generator actors (vLLM engines); default from config")
    p.add_argument("--learners", type=int, help="learner ranks (DeepSpeed engines); default from config")
    p.add_argument("--config", help="YAML file of config sections (see async_rlhf/config.py)")
    p.add_argument("--model", help="Hugging Face causal-LM directory; default: the tiny model + SFT warm start")
    p.add_argument("--address", help="Ray cluster to join (default: start Ray on this machine)")
    p.add_argument("--run-dir", help="run directory (default runs/demo)")
    p.add_argument("overrides", nargs="*", help="config overrides such as train.steps=100")
    return p.parse_args(argv)


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
    cfg = load_config(args.config, overrides)
    if cfg.model.path:
        check_model_dir(cfg.model.path)
    return cfg


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from async_rlhf.config import ConfigError

    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from async_rlhf.runner import run

    run(cfg, address=args.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
