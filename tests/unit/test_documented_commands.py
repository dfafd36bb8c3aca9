"""Every ``launch/cluster.py`` command that README.md and docs/*.md show still parses and validates (issue 48).

A renamed config key, a flag that went away or a file a command names that nothing makes would otherwise leave
a documented command broken until a user tries it. For each command (in a fenced block, or in inline code):

    run             launch/cluster.py's own ``parse_args`` and ``build_config`` (every key and value, through
                    ``load_config``'s validation, the run-directory and resume checks, the chat check), in a
                    scratch directory, so nothing is started and nothing of this checkout is read or written;
                    never the placement, memory or --address checks (they ask the machine or the network)
    scale, stop     their own parsers (``parse_scale_args``, ``parse_stop_args``)

A file or directory a command names (``--config``, ``--model``, ``--resume``, scale's and stop's ``--run-dir``,
and the path keys in ``PATH_KEYS``) must be a file of the repository, or be made by an earlier command of the same
block (its ``--out``, a ``>`` redirection, a run's ``run.dir``), or be an explicit placeholder of ``PLACEHOLDERS``.
The check then hands the launcher a stand-in of the right kind in the scratch directory (a model directory with a
``config.json``, a prompt file, a reward function, a run directory with a checkpoint written by the command that
made it), so the rest of the command is checked as a user would run it. A broken command fails naming its file
and line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

from async_rlhf.checkpoint_layout import FORMAT, MANIFEST, checkpoint_name, checkpoints_dir
from async_rlhf.config import Config, ConfigError, parse_reward_models

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LAUNCHER = "launch/cluster.py"

PLACEHOLDERS: dict[str, str] = {
    "/path/to/hf-causal-lm": "the user's own Hugging Face causal-LM directory",
    "SFT_DIR": "the user's SFT model directory (the block below shows how one is made)",
    "RM_DIR": "the user's reward-model directory (the block below shows how one is made)",
    "run.yaml": "the user's own config file; the page says what it holds",
    "chat.jsonl": "the user's prompt file; the page shows its format",
    "chat_heldout.jsonl": "the user's held-out prompt file; the page shows its format",
    "my_reward.py:score": "the reward function the page shows in a Python block of its own",
    "D": "the run directory of a running job, named in the same table row",
    "DIR": "the run directory of a running job, named in the same sentence",
    "...": "marks arguments left out (the text says which); the arguments shown are still checked",
}
"""Values a documented command may name without anything making them, each with the reason."""

PATH_KEYS: dict[str, str] = {
    "model.path": "causal_lm",
    "train.ppo.critic_path": "causal_lm",
    "rewards.model_path": "classifier",
    "train.ppo.reward_models": "classifiers",
    "prompts.path": "prompts",
    "prompts.eval_path": "prompts",
    "rewards.function": "function",
}
"""Config keys whose value names a file or directory, and the kind of stand-in the launcher's checks accept."""

OUTPUT_FLAGS = ("--out", "--output", "--out-dir", "--cache", "--run-dir")
"""Flags by which a command other than a run says what it makes (``--out runs/offline/sft``)."""

SEPARATORS = {";", "&&", "||", "|", "&", "(", ")"}
NOT_IN_A_FRESH_CLONE = ("runs/", ".venv")
"""Paths present in this checkout that a fresh clone lacks (what runs and the set-up make): never 'in the repo'."""


def _launcher() -> ModuleType:
    spec = importlib.util.spec_from_file_location("launch_cluster_for_docs", ROOT / "launch" / "cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cluster = _launcher()


@dataclass
class Command:
    line: int
    tokens: list[str]
    """Everything after ``launch/cluster.py``; any other command keeps its whole token list."""
    launcher: bool


@dataclass
class Block:
    """A fenced code block, or one inline code span: 'an earlier command of the same block' is counted in it."""

    path: Path
    line: int
    lines: list[tuple[int, str]]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def find_blocks(path: Path) -> list[Block]:
    """The fenced blocks and the inline code spans of a markdown file that mention the launcher."""
    lines = path.read_text().splitlines()
    prose = list(lines)  # the file with fenced lines blanked, for inline spans (line numbers kept)
    found: list[Block] = []
    fence: str | None = None
    body: list[tuple[int, str]] = []
    start = 0
    for number, text in enumerate(lines, 1):
        mark = re.match(r"\s*(`{3,}|~{3,})", text)
        if fence is None and mark:
            fence, start, body = mark.group(1), number, []
            prose[number - 1] = ""
        elif fence is not None:
            prose[number - 1] = ""
            if text.strip().startswith(fence):
                if any(LAUNCHER in t for _, t in body):
                    found.append(Block(path, start, body))
                fence = None
            else:
                body.append((number, text))
    joined = "\n".join(prose)
    for span in re.finditer(r"(`+)(.+?)\1", joined, re.S):
        if LAUNCHER in span.group(2):
            number = joined.count("\n", 0, span.start()) + 1
            found.append(Block(path, number, [(number, span.group(2).replace("\n", " "))]))
    return found


def commands(block: Block) -> list[Command]:
    """The block's simple commands in order (continuation lines joined; comments, ``;``, ``&&``, ``&`` handled)."""
    logical: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in block.lines:
        if pending is not None:
            number, text = pending[0], pending[1] + " " + text
        if text.rstrip().endswith("\\"):
            pending = (number, text.rstrip()[:-1])
            continue
        pending = None
        logical.append((number, text))
    if pending is not None:
        logical.append(pending)
    out: list[Command] = []
    for number, text in logical:
        lex = shlex.shlex(text, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        current: list[str] = []
        for token in [*lex, ";"]:
            if token not in SEPARATORS:
                current.append(token)
                continue
            if current:
                at = next((i for i, t in enumerate(current) if t.endswith(LAUNCHER)), None)
                out.append(Command(number, current if at is None else current[at + 1:], at is not None))
            current = []
    return out


def outputs(tokens: list[str]) -> list[str]:
    """What a command other than a run makes: the values of its output flags and of ``>`` redirections."""
    made = []
    for i, token in enumerate(tokens):
        flag, eq, value = token.partition("=")
        if eq and flag in OUTPUT_FLAGS:
            made.append(value)
        elif (token in OUTPUT_FLAGS or token in (">", ">>")) and i + 1 < len(tokens):
            made.append(tokens[i + 1])
    return made


def norm(path: str) -> str:
    return os.path.normpath(path)


class Broken(Exception):
    """One documented command that does not validate; the message says why."""


@dataclass
class Checker:
    """Validates one block's commands in order, remembering what each makes."""

    scratch: Path
    made: dict[str, Config | None] = field(default_factory=dict)
    """Paths made by earlier commands of the block: a run's ``run.dir`` (with its config), other outputs (None)."""
    used: set[str] = field(default_factory=set)
    """Placeholders the block named (the allow-list is checked for entries nothing uses)."""
    counter: int = 0

    def __post_init__(self) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)

    def maker(self, value: str) -> str | None:
        """The path an earlier command made that ``value`` is (or lies under), if any."""
        v = norm(value)
        return next((m for m in self.made if v == m or v.startswith(m + os.sep)), None)

    def stand_in_path(self, value: str) -> Path:
        self.counter += 1
        return self.scratch / "stand-ins" / f"{self.counter}-{re.sub(r'[^A-Za-z0-9._-]+', '_', value)}"

    def resolve(self, value: str, kind: str, what: str) -> str:
        """The path to hand the launcher for ``value``: the repository's file, or a stand-in; Broken otherwise."""
        if value in PLACEHOLDERS:
            self.used.add(value)
        elif self.maker(value) is None:
            real = ROOT / value
            if not value.startswith(NOT_IN_A_FRESH_CLONE) and (Path(value).is_absolute() or real.exists()):
                if not real.exists():
                    raise Broken(f"{what} {value}: no such file or directory")
                return str(real)
            raise Broken(f"{what} {value}: not a file of the repository, not made by an earlier command of the "
                         "block, and not a placeholder of tests/unit/test_documented_commands.py's PLACEHOLDERS")
        return str(STAND_INS[kind](self, value))

    def check(self, command: Command) -> None:
        if not command.launcher:
            for path in outputs(command.tokens):
                self.made[norm(path)] = None
            return
        tokens = [t for t in command.tokens if t != "..."]
        if len(tokens) < len(command.tokens):
            self.used.add("...")
        if tokens[:1] in (["scale"], ["stop"]):
            parser = cluster.parse_scale_args if tokens[0] == "scale" else cluster.parse_stop_args
            args = parse(parser, tokens[1:])
            self.resolve(args.run_dir, "existing", f"{tokens[0]} --run-dir")
            return
        args = parse(cluster.parse_args, tokens)
        args.checkpoint = None
        resumed = args.resume
        if args.config:
            args.config = self.resolve(args.config, "yaml", "--config")
        if args.model:
            args.model = self.resolve(args.model, "causal_lm", "--model")
        if args.resume:
            args.resume = self.resolve(args.resume, "run", "--resume")
        args.overrides = [self.override(item) for item in args.overrides]
        here = Path.cwd()
        os.chdir(self.scratch)  # relative paths (run.dir's default runs/demo) land in the scratch directory
        try:
            cfg = cluster.build_config(args)
        except ConfigError as exc:
            raise Broken(f"refused: {exc}") from None
        finally:
            os.chdir(here)
        if not args.dry_run:
            run_dir = resumed if resumed and not args.run_dir else cfg.run.dir
            self.made[norm(run_dir)] = cfg

    def override(self, item: str) -> str:
        key, eq, value = item.partition("=")
        kind = PATH_KEYS.get(key.strip())
        if not eq or not value or kind is None:
            return item  # load_config refuses what is not key=value, naming it
        if kind == "classifiers":
            return f"{key}=" + ",".join(f"{self.resolve(d, 'classifier', key)}:{w:g}"
                                        for d, w in parse_reward_models(value))
        target, sep, name = value.rpartition(":")
        if kind in ("function", "prompts") and sep and target.endswith(".py"):
            return f"{key}={self.resolve(value, 'function', key)}"
        if kind == "function":
            return item  # module:function, imported where it runs
        return f"{key}={self.resolve(value, kind, key)}"


def parse(parser: Callable[[list[str]], argparse.Namespace], tokens: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser(tokens)
    except SystemExit:
        raise Broken("refused by the launcher's parser: " + err.getvalue().strip().splitlines()[-1]) from None


def _model_dir(checker: Checker, value: str, architecture: str) -> Path:
    """A Hugging Face model directory as the launcher reads it (JSON only): its architecture, its window, and the
    completion length its generation_config.json gives (so the command is checked, not the stand-in's limits)."""
    d = checker.stand_in_path(value)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": [architecture], "num_labels": 1,
                                               "max_position_embeddings": 2048}))
    (d / "generation_config.json").write_text(json.dumps({"max_new_tokens": 64}))
    return d


def _prompts(checker: Checker, value: str) -> Path:
    p = checker.stand_in_path(value).with_suffix(".jsonl")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"prompt": "12+30=", "answer": "042"}) + "\n")
    return p


def _function(checker: Checker, value: str) -> str:
    _, _, name = value.rpartition(":")
    p = checker.stand_in_path(value).with_suffix(".py")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f"def {name}(prompt, completion, data, **kwargs):\n    return 0.0\n")
    return f"{p}:{name}"


def _yaml(checker: Checker, value: str) -> Path:
    p = checker.stand_in_path(value).with_suffix(".yaml")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("{}\n")
    return p


def _run(checker: Checker, value: str) -> Path:
    """A run directory as the run that made it leaves it: its config.json and its last checkpoint (at that run's
    train.steps, or the step a ``checkpoints/step-N`` value names; a placeholder's at step 1, with the default
    config)."""
    maker = checker.maker(value)
    cfg = (checker.made.get(maker) if maker else None) or Config()
    steps = cfg.train.steps if maker and checker.made.get(maker) else 1
    named = Path(value)
    if named.parent.name == "checkpoints" and named.name.startswith("step-"):  # a checkpoint named by its step
        steps = int(named.name.removeprefix("step-"))
    d = checker.stand_in_path(value)
    ckpt = checkpoints_dir(d) / checkpoint_name(steps)
    for part in ("deepspeed", "policy"):
        (ckpt / part).mkdir(parents=True)
    (ckpt / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": steps}))
    (d / "config.json").write_text(cfg.to_json())
    return d


STAND_INS: dict[str, Callable[[Checker, str], object]] = {
    "causal_lm": lambda c, v: _model_dir(c, v, "Qwen2ForCausalLM"),
    "classifier": lambda c, v: _model_dir(c, v, "Qwen2ForSequenceClassification"),
    "prompts": _prompts,
    "function": _function,
    "yaml": _yaml,
    "run": _run,
    "existing": lambda c, v: v,  # scale and stop only need it to exist (made earlier, or a placeholder)
}


def check_block(block: Block, scratch: Path) -> tuple[list[str], set[str]]:
    """One line per broken command (``file:line: command: why``), and the placeholders the block used."""
    checker = Checker(scratch)
    problems = []
    for command in commands(block):
        try:
            checker.check(command)
        except Broken as exc:
            where = f"{block.where.rsplit(':', 1)[0]}:{command.line}"
            problems.append(f"{where}: launch/cluster.py {' '.join(command.tokens)}: {exc}")
    return problems, checker.used


BLOCKS = [b for doc in DOCS for b in find_blocks(doc)]


def test_the_docs_show_launcher_commands_where_expected() -> None:
    """The finder still finds them (a change of markdown or of this file's parsing would pass every check)."""
    where = {b.path.name for b in BLOCKS}
    assert {"README.md", "configuration.md", "algorithms.md", "multi_node.md"} <= where, where
    found = [c for b in BLOCKS for c in commands(b) if c.launcher]
    assert any(c.tokens[:1] == ["scale"] for c in found) and any(c.tokens[:1] == ["stop"] for c in found)
    assert sum(1 for c in found if "--resume" in c.tokens) >= 1


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_documented_command_validates(block: Block, tmp_path: Path) -> None:
    problems, _ = check_block(block, tmp_path)
    assert not problems, "documented commands that do not validate:\n" + "\n".join(problems)


def test_every_placeholder_is_still_used(tmp_path: Path) -> None:
    used: set[str] = set()
    for i, block in enumerate(BLOCKS):
        used |= check_block(block, tmp_path / str(i))[1]
    assert set(PLACEHOLDERS) - used == set(), "remove these from PLACEHOLDERS: no documented command names them"


def test_a_broken_command_fails_naming_its_file_and_line(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("# Page\n\nRun `launch/cluster.py train.no_such_key=3`, or:\n\n```bash\n"
                   "python launch/cluster.py --generators 2 train.steps=10\n"
                   "python launch/cluster.py --resume runs/demo train.steps=5 \\\n    train.lr=1e-4\n"
                   "python launch/cluster.py --model runs/nowhere\n"
                   "python launch/cluster.py scale --run-dir runs/demo\n```\n")
    found = []
    for block in find_blocks(doc):
        found += check_block(block, tmp_path / str(block.line))[0]
    page = str(doc)
    assert len(found) == 4, found
    assert found[0].startswith(f"{page}:7: ") and "at step 10 and train.steps is 5" in found[0], found[0]
    assert found[1].startswith(f"{page}:9: ") and "--model runs/nowhere: not a file of the repository" in found[1]
    assert found[2].startswith(f"{page}:10: ") and "--generators" in found[2], found[2]
    assert found[3].startswith(f"{page}:3: ") and "unknown config key 'train.no_such_key'" in found[3], found[3]
