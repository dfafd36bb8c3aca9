"""Fleet: groups a durable buffer saw trained after the checkpoint a run resumed from were undone with the
model; a (re)starting generator must issue their prompts again, not take them for done. The buffer client and
cluster are stand-ins (no Ray is needed for the stream plan); the subject is the fleet's plan input."""

from types import SimpleNamespace

from async_rlhf.driver.fleet import Fleet
from async_rlhf.driver.prompt_ledger import PromptLedger


class Buffer:
    def stats(self, ledger: bool = False, ledger_of: dict | None = None) -> dict:
        return {"ledger": {"held": ["g0-a-7"], "delivered": ["g0-a-8"], "trained": ["g0-a-3", "g0-a-5"]}}


def test_groups_trained_after_the_checkpoint_are_not_taken_for_done():
    ledger = PromptLedger.from_state({"0": {"position": 8, "pending": [3, 5, 7, 8], "skip": []}})
    fleet = Fleet(SimpleNamespace(generators=[]), ledger, Buffer(), 2, rolled_back={"g0-a-5"})
    keys = fleet._buffer_keys([0])
    assert sorted(keys) == ["g0-a-3", "g0-a-7", "g0-a-8"]
    plan = ledger.plan(0, keys)
    assert plan.reissue == [5], "the prompt whose training was rolled back is issued again"
