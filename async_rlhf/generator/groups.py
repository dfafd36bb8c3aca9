"""Prompt groups from admission to the buffer: environment rollouts, rewards (immediate or late), put.

Coroutines on an event loop owned by the generator's loop thread, run in slices between engine steps by
:meth:`GroupRunner.pump` (nothing here blocks the engine for long: the buffer calls are short requests)::

    start(gid, prompt) -> task: env.rollout_group (rollout x group_size)      engine requests via the policy
                            every reward source immediate?  score_now -> queued; at the end of the pump
                                                          the groups rewarded in it go in one put
                            otherwise                     put(group, rewards_pending) -> task keeps awaiting
                                                          rewards.score (timeout) -> client.reward(gid, ...)
                                                                                     on the reward thread

Late rewards are sent from a few threads of their own, each with a client of its own (``reward_client``; a
ZeroMQ socket belongs to one thread): a slow or restarting buffer then delays that reward only, never the loop,
the other groups' rewards or the engine steps between which the loop runs.

Kept apart from the Ray actor on purpose: an actor class with ``async def`` methods becomes an asyncio actor
in Ray, whose synchronous methods then queue behind the long-running loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from async_rlhf.buffer.client import BufferClient, with_retry
from async_rlhf.env.base import DropGroup, Environment, Policy, Prompt, Trajectory
from async_rlhf.generator.rollout import to_group
from async_rlhf.rewards.base import Completion, RewardSource
from async_rlhf.types import Group

log = logging.getLogger(__name__)

REWARD_THREADS = 4
"""Late rewards sent at once; one the buffer is slow to answer holds back none of the others."""

Record = Callable[[str, str, "list[float] | None", str], None]
"""record(event, group_id, rewards, reason): events put | put_pending | rewarded | dropped | <counter name>."""


class GroupRunner:
    def __init__(self, env: Environment, rewards: RewardSource, policy: Policy, client: BufferClient, *,
                 group_size: int, reward_timeout_s: float, patience_s: float, generator: int,
                 current_version: Callable[[], int], record: Record,
                 on_reward_phase: Callable[[], None] = lambda: None,
                 reward_client: Callable[[], BufferClient] | None = None,
                 on_returns: Callable[[Prompt, list[float]], None] = lambda prompt, returns: None) -> None:
        """``reward_client``: makes the client late rewards are sent with (called once on each reward thread);
        None shares ``client``, which must then be safe to call from other threads. ``on_returns``: told each
        group's returns once they are known (on the loop thread; the prompt filter learns from them)."""
        self.env, self.rewards, self.policy, self.client = env, rewards, policy, client
        self._reward_client_factory = reward_client
        self._local = threading.local()
        self._reward_clients: list[BufferClient] = []
        self._reward_pool = ThreadPoolExecutor(max_workers=REWARD_THREADS, thread_name_prefix="late-reward")
        self.group_size = group_size
        self.reward_timeout_s = reward_timeout_s
        self.patience_s = patience_s
        self.generator = generator
        self.current_version = current_version
        self.record = record
        self.on_reward_phase = on_reward_phase
        self.on_returns = on_returns
        self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop()  # not Ray's uvloop policy
        self.groups: dict[str, asyncio.Task[None]] = {}
        """Admitted and not yet put (trajectories being generated)."""
        self.reward_tasks: set[asyncio.Task[None]] = set()
        """Put with rewards pending; their rewards are still being computed."""
        self.last_pump = 0.0
        self._rewarded: list[Group] = []
        """Groups rewarded during this pump, put together at its end (still in ``groups`` until then)."""

    def start(self, gid: str, prompt: Prompt, prompt_ids: list[int]) -> None:
        self.groups[gid] = self.loop.create_task(self._play(gid, prompt, prompt_ids), name=gid)

    def pending_rewards(self) -> list[str]:
        """Ids of the groups put with rewards pending whose rewards are still being computed or sent."""
        return sorted(t.get_name() for t in self.reward_tasks)

    def settle(self, timeout_s: float, poll_s: float = 0.005,
               give_up: Callable[[], bool] = lambda: False) -> list[str]:
        """Let the pending late rewards finish (a draining generator, before it exits), for at most
        ``timeout_s`` or until ``give_up()``; returns the ids still pending then. Each reward is bounded by
        ``reward_timeout_s`` plus the buffer's patience, so ``timeout_s`` of that much lets every one end."""
        deadline = time.monotonic() + timeout_s
        while self.reward_tasks and time.monotonic() < deadline and not give_up():
            self.pump()
            time.sleep(poll_s)
        return self.pending_rewards()

    def abandon_pending(self) -> list[str]:
        """Cancel the rewards still pending and have the buffer drop those groups now (reason
        ``reward_abandoned``: their admission goes back at once, and the driver's prompt ledger keeps their
        prompts outstanding, to be issued again) instead of letting them time out; returns their ids."""
        gids = self.pending_rewards()
        if not gids:
            return []
        for task in list(self.reward_tasks):
            task.cancel()
        self.pump()
        try:
            with_retry(lambda: self.client.abandon(gids), f"abandon of {len(gids)} group(s)", self.patience_s)
        except Exception as exc:  # noqa: BLE001 - the buffer drops them at its reward deadline anyway
            log.warning("generator %d: could not abandon groups %s: %s", self.generator, gids, exc)
        for gid in gids:  # already in the generator's ledger (put with rewards pending): only counted
            self.record("reward_abandoned", gid, None, "reward_abandoned")
        return gids

    def pump(self) -> None:
        """Run every coroutine that can proceed: a few loop iterations let a finished turn resume its
        environment, a finished rollout its group, which then rewards and puts."""
        self.last_pump = time.monotonic()
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))
        self._put_rewarded()

    def _put_rewarded(self) -> None:
        """Put the groups rewarded during this pump in one request: each put is a round trip to the buffer the
        loop waits for, and one per group took a fifth of a generator's time on the tiny model. A buffer that
        stays unreachable leaves them admitted and not put (as a failed single put did); the loop releases them
        when it ends."""
        if not self._rewarded:
            return
        batch, self._rewarded = self._rewarded, []
        try:
            with_retry(lambda: self.client.put_many(batch), f"put of {len(batch)} group(s)", self.patience_s)
        except Exception as exc:  # noqa: BLE001 - logged; the groups stay open, released at the end
            log.warning("generator %d: could not put %d group(s) (%s): %s", self.generator, len(batch),
                        ", ".join(g.group_id for g in batch), exc)
            return
        for group in batch:
            del self.groups[group.group_id]
            self.record("put", group.group_id, [s.reward for s in group.samples], "")

    def cancel_all(self) -> int:
        """Cancel every group and reward task (the loop is ending); returns how many groups were not put."""
        open_groups = len(self.groups)
        for task in [*self.groups.values(), *self.reward_tasks]:
            task.cancel()
        self.pump()
        return open_groups

    def close(self) -> None:
        self.loop.close()
        self._reward_pool.shutdown(wait=False, cancel_futures=True)
        # a send still under way may retry for patience_s: its client is closed once the threads are done
        threading.Thread(target=self._close_reward_clients, name="late-reward-close", daemon=True).start()

    def _close_reward_clients(self) -> None:
        self._reward_pool.shutdown(wait=True)
        for client in self._reward_clients if self._reward_client_factory is not None else []:
            client.close()
        self._reward_clients.clear()

    def _send_reward(self, gid: str, returns: list[float]) -> dict[str, Any]:
        """Runs on a reward thread: the blocking request, retried while the buffer is unreachable."""
        client = getattr(self._local, "client", None)
        if client is None:
            factory = self._reward_client_factory
            client = self._local.client = factory() if factory is not None else self.client
            self._reward_clients.append(client)
        return with_retry(lambda: client.reward(gid, returns), f"reward {gid}", self.patience_s)

    async def _play(self, gid: str, prompt: Prompt, ids: list[int]) -> None:
        n, start_version, t_start = self.group_size, self.current_version(), time.time()
        try:  # the group's prompt may be the environment's own (an agent's episodes: what they share)
            ids, trajs = await self.env.rollout_group(gid, prompt, ids, n, self.policy)
        except asyncio.CancelledError:
            raise
        except DropGroup as exc:
            log.warning("generator %d: group %s dropped: %s", self.generator, gid, exc)
            self._fail(gid, exc.reason, exc.reason)
            return
        except Exception as exc:  # a user environment must never take the generator down
            log.exception("generator %d: environment %s failed on group %s", self.generator, self.env.name, gid)
            self._fail(gid, f"env_error: {exc!r}", "env_errors")
            return
        if all(t.finish_reason == "length" and not any(t.loss_mask) for t in trajs):
            # the prompt left no room in the context window: empty completions, nothing to train (prompt_fit.py);
            # _draw passes such prompts over, this is one it could not (a re-issued one, or none other ready)
            self._fail(gid, "prompt_too_long", "prompts_too_long")
            return
        for t in trajs:  # legitimate, but a user should see the share (rollout/truncated)
            if t.finish_reason == "length":
                self.record("samples_truncated", gid, None, "")
        # the text, plus the token ids, finish reason and prompt ids a reward function may ask for (rewards/base.py)
        texts: list[str] = [Completion(t.text, t.token_ids, t.finish_reason, ids) for t in trajs]
        meta: dict[str, Any] = {"prompt": prompt.text, **prompt.data}
        self.on_reward_phase()
        if self.rewards.immediate:
            try:
                final = self.rewards.score_now(prompt, texts)
            except Exception as exc:  # a user reward function must never take the generator down
                log.exception("generator %d: reward failed for group %s", self.generator, gid)
                self._fail(gid, f"reward_error: {exc!r}", "reward_errors")
                return
            group = to_group(gid, ids, trajs, final, self.generator, meta, start_version, t_start)
            self.on_returns(prompt, [s.reward for s in group.samples])
            self._rewarded.append(group)
            return  # put at the end of this pump
        group = to_group(gid, ids, trajs, [0.0] * n, self.generator, meta, start_version, t_start)
        with_retry(lambda: self.client.put(group, rewards_pending=True), f"put {gid}", self.patience_s)
        del self.groups[gid]
        self.record("put_pending", gid, None, "")
        task = asyncio.current_task()
        assert task is not None
        self.reward_tasks.add(task)
        try:
            await self._late_reward(gid, prompt, trajs, texts)
        finally:
            self.reward_tasks.discard(task)

    def _fail(self, gid: str, reason: str, counter: str) -> None:
        del self.groups[gid]
        self.record("dropped", gid, None, reason)
        self.record(counter, gid, None, reason)
        self.client.release(1)

    async def _late_reward(self, gid: str, prompt: Prompt, trajs: list[Trajectory], texts: list[str]) -> None:
        """Await the sources; send the returns to the buffer. Failures are counted, the buffer drops the group
        after ``buffer.reward_deadline_s`` with reason ``reward_timeout``."""
        try:
            final = await asyncio.wait_for(self.rewards.score(prompt, texts), self.reward_timeout_s)
        except asyncio.TimeoutError:
            log.warning("generator %d: no reward for group %s within rewards.timeout_s=%g s; the buffer drops it",
                        self.generator, gid, self.reward_timeout_s)
            self.record("reward_timeouts", gid, None, "reward_timeout")
            return
        except Exception as exc:  # noqa: BLE001 - counted; never stops the generator
            log.warning("generator %d: reward failed for group %s: %s", self.generator, gid, exc)
            self.record("reward_errors", gid, None, f"reward_error: {exc!r}")
            return
        returns = [t.env_return + f for t, f in zip(trajs, final)]
        self.on_returns(prompt, returns)
        try:
            answer = await self.loop.run_in_executor(self._reward_pool, self._send_reward, gid, returns)
        except Exception as exc:  # noqa: BLE001 - the buffer stayed unreachable: counted, the buffer drops it
            log.warning("generator %d: could not send the late reward of %s: %s", self.generator, gid, exc)
            self.record("reward_errors", gid, None, f"reward_send_error: {exc!r}")
            return
        # this runner rewards each group once, so "already_rewarded" means a retry whose first reply was lost
        if not answer["ok"] and answer.get("reason") != "already_rewarded":  # e.g. dropped: deadline passed
            log.warning("generator %d: the buffer refused the late reward of %s: %s", self.generator, gid,
                        answer["reason"])
            self.record("reward_timeouts", gid, None, str(answer["reason"]))
            return
        self.record("rewarded", gid, returns, "")
