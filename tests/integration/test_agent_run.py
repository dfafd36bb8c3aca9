"""An agent run on the real stack (issue 45): the launcher with ``task.name=agent`` and a user's agent file that
drives every episode through its generator's OpenAI-compatible endpoint with the stock ``openai`` SDK (streamed),
vLLM generators, a DeepSpeed learner, the buffer and the gloo push all real.

One run (the demo's fleet and warm start, 30 steps: the plain task is solved by then): it learns as the plain task
does, every trained sampled id is the engine's own (summary.json's ``agent_token_mismatch`` is 0), and the agent
counters add up. A second run, the tool-use task (``agent.task=calculator``, the shipped calculator agent, the tiny
tool policy whose warm start never calls the tool greedily): held-out accuracy rises by 0.3 or more and the end
policy calls the tool, with tool calls parsed by the ``tiny_calculator`` vLLM parser and spliced exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30

AGENT = '''
"""A user's agent: streams its answer with the stock SDK and scores it."""
async def run(task, client):
    stream = await client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=8,
                                                  stream=True)
    text = ""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    digits = ""
    for ch in text:
        if not ch.isdigit():
            break
        digits += ch
    return 1.0 if digits == task["answer"] else 0.0
'''


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("agent")
    (work / "my_agent.py").write_text(AGENT)
    run_dir = work / "run"
    args = [sys.executable, str(ROOT / "launch" / "cluster.py"), "--generators", "2", "--learners", "1",
            "task.name=agent", f"agent.entry={work / 'my_agent.py'}:run", f"train.steps={STEPS}",
            f"run.dir={run_dir}", "generator.eval_every=10"]
    # from the repository: the demo's warm start (runs/cache, built by `make setup`) is the policy
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the agent run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "console": proc.stdout}


def test_agent_run_learns_and_trains_exactly_what_was_sampled(agent_run: dict) -> None:
    s = agent_run["summary"]
    assert s["steps"] == STEPS
    assert s["agent_token_mismatch"] == 0
    assert s["accuracy_end"] - s["accuracy_start"] >= 0.3, (s["accuracy_start"], s["accuracy_end"])


def test_agent_counters_add_up(agent_run: dict) -> None:
    s = agent_run["summary"]
    # one turn per episode (this agent asks once); every generated group is train.group_size (8) episodes
    assert s["agent_episodes"] >= s["groups_generated"] * 8 > 0
    assert s["agent_turns"] == s["agent_episodes"]
    assert s["agent_errors"] == s["agent_timeouts"] == s["agent_forks"] == 0
    assert s["agent_tool_calls"] == s["agent_tool_parse_errors"] == 0


@pytest.fixture(scope="module")
def calculator_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("calculator") / "run"
    args = [sys.executable, str(ROOT / "launch" / "cluster.py"), "--generators", "2", "--learners", "1",
            "task.name=agent", "agent.task=calculator", f"train.steps={STEPS}",  # the task brings its agent, parser
            f"run.dir={run_dir}", "generator.eval_every=10"]
    # from the repository: the tiny tool policy's warm start (runs/cache, built by `make setup`) is the policy
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the calculator run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    start = json.loads((run_dir / "reference.json").read_text())["path"]
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "start": Path(start),
            "end": run_dir / "policy"}


def test_the_tool_task_learns_to_call_the_calculator(calculator_run: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from async_rlhf.env.arithmetic import AdditionTask
    from async_rlhf.tiny.tool_policy import play_greedy
    from async_rlhf.tokenizer import load_tokenizer

    s = calculator_run["summary"]
    assert s["steps"] == STEPS and s["agent_token_mismatch"] == 0
    assert s["accuracy_end"] - s["accuracy_start"] >= 0.3, (s["accuracy_start"], s["accuracy_end"])
    start_info = json.loads((calculator_run["start"] / "tiny_info.json").read_text())
    assert start_info["heldout_greedy_tool_share"] <= 0.1  # the warm start answers from memory
    end = calculator_run["end"]
    model = AutoModelForCausalLM.from_pretrained(str(end), dtype=torch.float32)
    figures = play_greedy(model, load_tokenizer(end), AdditionTask().heldout())
    assert figures["tool_share"] >= 0.5, figures
    assert figures["accuracy"] == pytest.approx(s["accuracy_end"])


def test_tool_calls_are_parsed_and_spliced(calculator_run: dict) -> None:
    s = calculator_run["summary"]
    # a call is a turn and its result another: an episode that calls once has two turns
    assert s["agent_tool_calls"] > 0 and s["agent_turns"] <= s["agent_episodes"] + s["agent_tool_calls"]
    assert s["agent_tool_parse_errors"] <= 0.01 * s["agent_tool_calls"]  # malformed calls: content, counted
    assert s["agent_errors"] == s["agent_timeouts"] == s["agent_forks"] == 0
