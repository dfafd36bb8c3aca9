"""Prompt strides across fleet sizes (issue 44, defect 7): a resume with another ``--generators`` deals what the old
lanes left (open positions, places a slower lane never reached) to the new fleet, so every global index of the
source (every record of an epoch) is issued exactly once whatever the fleet sizes; the checkpoint records the
fleet size its positions are strides of."""

from __future__ import annotations

import itertools
import random

import pytest

from async_rlhf.driver.prompt_ledger import PromptLedger
from async_rlhf.generator.lanes import Layout, OffsetStream, file_prompts_at, items_at
from async_rlhf.generator.stream import PromptStream, group_id
from async_rlhf.prompts.files import epochs


def test_the_default_layout_is_the_strides_of_epochs() -> None:
    records = [{"prompt": f"r{i}"} for i in range(7)]
    for lanes in (1, 2, 3):
        layout = Layout.default(lanes)
        for lane in range(lanes):
            want = list(itertools.islice(epochs(records, "prompt", 5, lane, lanes), 40))
            got = list(file_prompts_at(records, "prompt", 5, itertools.islice(layout.lane_globals(lane), 40)))
            assert got == want
    assert list(items_at(range(100, 200), [0, 3, 4, 9])) == [100, 103, 104, 109]
    layout = Layout(3, {0: 4}, [(1, 3), (7, 8)], 20)
    assert Layout.from_dict(layout.to_dict()) == layout


def test_layout_places_and_suffix() -> None:
    layout = Layout(2, {}, [(3, 5), (9, 10)], 20)  # V = 3, 4, 9, 20, 21, ...
    assert [layout.at(v) for v in range(6)] == [3, 4, 9, 20, 21, 22]
    assert list(itertools.islice(layout.lane_globals(1), 4)) == [4, 20, 22, 24]
    assert layout.suffix(1) == ([(4, 5), (9, 10)], 20) and layout.suffix(5) == ([], 22)


def test_an_offset_stream_numbers_positions_after_its_base() -> None:
    stream = OffsetStream(PromptStream(iter("abcdefg"), start=2, reissue=[1], skip=[4]), base=10)
    assert stream.position == 12 and stream.reissue_left == 1
    assert [next(stream) for _ in range(3)] == [(11, "a"), (13, "c"), (15, "e")]


def global_of(eras: list[Layout], gen: int, seq: int) -> int:
    """The global index of key ``gen:seq``: through the newest layout whose base it lies beyond."""
    for layout in reversed(eras):
        base = layout.base.get(gen, 0)
        if seq > base:
            assert gen < layout.lanes, f"{gen}:{seq} drawn beyond the fleet"
            return layout.at(gen + (seq - base - 1) * layout.lanes)
    raise AssertionError(f"{gen}:{seq} lies in no layout")


@pytest.mark.parametrize("sizes", [(2, 3), (3, 1), (4, 2, 5), (2, 2, 1, 3), (1, 4)])
def test_every_global_index_is_issued_once_across_fleet_sizes(sizes: tuple[int, ...]) -> None:
    check_eras(sizes, sum(sizes) * 31 + len(sizes))


def test_every_global_index_is_issued_once_across_random_fleet_histories() -> None:
    rng = random.Random(7)
    for seed in range(60):
        check_eras(tuple(rng.randint(1, 6) for _ in range(rng.randint(2, 5))), seed)


def check_eras(sizes: tuple[int, ...], seed: int) -> None:
    """Each era: every generator of the fleet plans its stream, draws a few prompts (trained, held by a durable
    buffer or lost); then the job resumes with the next fleet size."""
    rng = random.Random(seed)
    ledger = PromptLedger(layout=Layout.default(sizes[0]))
    eras = [ledger.layout]
    used: list[int] = []  # globals trained (or to be trained: held by a durable buffer at a resume)
    for era, lanes in enumerate(sizes):
        assert ledger.layout is not None and ledger.layout.lanes == lanes
        in_buffer: list[str] = []
        for gen in range(lanes):
            plan = ledger.plan(gen)
            start = plan.position
            draws = rng.randint(0, 25)  # lanes run at different speeds (or not at all)
            drawn = list(plan.reissue) + list(range(start + 1, start + 1 + draws))
            ledger.observe_position(gen, start + draws)
            for seq in drawn:
                fate = rng.random()
                gid = group_id(gen, f"e{era}", seq)
                if fate < 0.7:  # trained
                    ledger.observe_trained([gid])
                    used.append(global_of(eras, gen, seq))
                elif fate < 0.8:  # held by a durable buffer: trained after the resume, under its key
                    in_buffer.append(gid)
                    used.append(global_of(eras, gen, seq))
                # else: in flight when the job died (open)
        nxt = sizes[era + 1] if era + 1 < len(sizes) else None
        if nxt is None:
            ledger.observe_trained(in_buffer)
            break
        out = ledger.relayout(nxt, in_buffer)
        for gid in in_buffer:  # the buffer trains them after the resume
            ledger.observe_trained([gid])
        assert ledger.duplicates == []
        eras.append(out.layout)
        assert out.abandoned == 0
    assert len(used) == len(set(used)), "a global index was issued twice"
    # complete: below the highest index used, every index is used, open in the ledger, or still to be dealt
    layout = eras[-1]
    open_ = {global_of(eras, g, s) for g, seqs in ledger.outstanding.items() for s in seqs}
    next_places = set()
    for g in range(layout.lanes):  # the places of V not drawn yet by the last fleet
        drawn = ledger.positions.get(g, 0) - layout.base.get(g, 0)
        next_places |= set(itertools.islice(layout.lane_globals(g), drawn, drawn + 400))
    top = max(used, default=0)
    missing = set(range(top)) - set(used) - open_ - next_places
    assert not missing, f"never issued: {sorted(missing)[:10]}"
    assert not (set(used) & next_places) and not (set(used) & open_)


def test_a_relayout_deals_open_positions_and_places_a_lane_never_reached_first() -> None:
    ledger = PromptLedger(layout=Layout.default(2))
    ledger.observe_position(0, 4)  # places 0, 2, 4, 6 of V; generator 1 drew nothing (1, 3, 5 never reached)
    ledger.observe_trained([group_id(0, "t", 1)])
    out = ledger.relayout(3)
    assert out.moved == 6 and out.layout == Layout(3, {0: 4}, [(1, 7)], 7)
    assert ledger.outstanding == {} and ledger.positions == {0: 4}
    assert [list(itertools.islice(out.layout.lane_globals(g), 3)) for g in range(3)] == [[1, 4, 7], [2, 5, 8],
                                                                                        [3, 6, 9]]


def test_outstanding_positions_of_an_earlier_layout_are_not_reissued() -> None:
    ledger = PromptLedger(layout=Layout.default(2))
    ledger.observe_position(0, 3)
    ledger.observe_position(1, 3)
    ledger.relayout(1, [group_id(0, "t", 2)])  # 0:2 held by the buffer: stays outstanding under its key
    assert ledger.outstanding == {0: {2}}
    ledger.observe_position(0, 5)
    plan = ledger.plan(0)  # the buffer dropped it meanwhile: an earlier layout's position cannot be replayed
    assert plan.reissue == [4, 5]


def test_generators_beyond_the_old_fleet_lose_only_their_own_shuffle() -> None:
    ledger = PromptLedger(layout=Layout.default(1))
    ledger.observe_position(0, 2)
    ledger.observe_position(1, 3)  # scaled up beyond the configured fleet: its own shuffle, no lane
    out = ledger.relayout(2, [])
    assert out.abandoned == 3 and out.layout.base == {0: 2, 1: 3}
    assert [list(itertools.islice(out.layout.lane_globals(g), 2)) for g in range(2)] == [[0, 2], [1, 3]]


def test_a_file_is_trained_once_per_epoch_across_a_resume_on_another_fleet(tmp_path) -> None:
    """The generators' side: each one's stream as ``GeneratorActor.run`` builds it (``lane_source`` over the file,
    ``offset_stream`` from the driver's plan), before and after a resume from 2 generators to 3."""
    from types import SimpleNamespace

    from async_rlhf.config import load_config
    from async_rlhf.driver.fleet import Fleet
    from async_rlhf.generator.lanes import lane_source, offset_stream

    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "r{i}"}}\n' for i in range(12)))
    cfg = load_config(None, ["prompts.source=file", f"prompts.path={path}", "generators=2"])
    ledger = PromptLedger(layout=Layout.default(2))
    drawn: list[str] = []
    for gen, n in ((0, 4), (1, 1)):  # generator 1 lagged; 0:3 and 0:4 were in flight at the kill
        plan = ledger.plan(gen)
        stream = offset_stream(lane_source(cfg, ledger.layout, gen), ledger.layout.base.get(gen, 0), plan.position,
                               plan.reissue, plan.skip)
        for _ in range(n):
            seq, prompt = next(stream)
            ledger.observe_position(gen, stream.position)
            if (gen, seq) not in ((0, 3), (0, 4)):
                ledger.observe_trained([group_id(gen, "a", seq)])
                drawn.append(prompt.text)
    cfg.generators = 3  # --resume ... --generators 3
    fleet = Fleet(SimpleNamespace(cfg=cfg, generators=[]), ledger, None, 0)
    fleet._deal_lanes([])
    assert ledger.layout.lanes == 3 and fleet.events[-1]["dealt_again"] == 2 + 2
    for gen in range(3):
        plan = ledger.plan(gen)
        stream = offset_stream(lane_source(cfg, ledger.layout, gen), ledger.layout.base.get(gen, 0), plan.position,
                               plan.reissue, plan.skip)
        for _ in range(6):
            seq, prompt = next(stream)
            assert seq > ledger.layout.base.get(gen, 0)
            drawn.append(prompt.text)
    # the 21 prompts trained are the first 21 of the source's sequence (epoch 1 whole, then 9 of epoch 2)
    records = [{"prompt": f"r{i}"} for i in range(12)]
    want = [p.text for p in file_prompts_at(records, "prompt", cfg.train.seed, range(21))]
    assert sorted(drawn) == sorted(want), "every record of the epoch once"


def test_a_resume_on_another_learner_world_size_is_refused_naming_the_fix() -> None:
    from async_rlhf.config import ConfigError, load_config
    from async_rlhf.driver.progress import check_learners, saved_layout

    cfg = load_config(None, ["learners=1"])
    check_learners({"learners": 1}, cfg, "ckpt")
    check_learners({}, cfg, "ckpt")  # written before the count was recorded: not checked
    with pytest.raises(ConfigError, match=r"written by 2 learner rank\(s\).*--learners 1.*resume with --learners 2"):
        check_learners({"learners": 2}, cfg, "ckpt")
    assert saved_layout({"layout": Layout(3, {1: 5}, [], 9).to_dict()}) == Layout(3, {1: 5}, [], 9)
    assert saved_layout({"generators": 2, "data": {}}) == Layout.default(2)


def test_a_generator_run_without_a_position_starts_its_stream_from_the_start() -> None:
    """A generator run without ``resume_stream`` (the pipeline benchmark drives its generators so) streams from
    position 1: ``run()`` called offset_stream with no position and failed with a TypeError."""
    from async_rlhf.generator.lanes import offset_stream

    stream = offset_stream(iter(["a", "b", "c"]), 0)
    assert [next(stream) for _ in range(2)] == [(1, "a"), (2, "b")]
