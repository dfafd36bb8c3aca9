"""Pure parts of the weight push: control messages, membership merging, byte views, zero-copy detection,
bucket sizing, error naming, and the sliced wait (against a fake work handle)."""

import time

import pytest
import torch

from async_rlhf.sync import protocol as P
from async_rlhf.sync.group import Aborted, SyncError, SyncTimeout, wait_work
from async_rlhf.sync.layout import ALIGN, TensorSpec, auto_bucket_bytes, chunk_ranges, plan_buckets
from async_rlhf.sync.sender import PushError
from async_rlhf.sync.tensors import (
    arena_offsets,
    as_bytes,
    check_cut,
    chunk_pieces,
    cut_arena,
    flatten_params,
    in_place_chunk,
    layout_digest,
    named_views,
)


def test_header_round_trip_and_rejects():
    h = P.Header(version=7, layout="ab12", cut=((0, 4096), (4096, 5000)))
    assert P.Header.decode(h.encode()) == h
    assert P.Header.decode(P.Header(next_epoch=3).encode()) == P.Header(next_epoch=3)
    with pytest.raises(ValueError):
        P.Header(version=1, next_epoch=2).encode()
    with pytest.raises(ValueError):
        P.Header().encode()
    too_fine = str([[i, i + 1] for i in range(P.MAX_CHUNKS + 1)])
    for bad in ['{"version": "7", "layout": "", "cut": []}', '{"version": 7}', '{"next": 1, "version": 2}', "[]",
                '{"other": 1}', '{"version": 7, "layout": 3, "cut": []}', '{"version": 7, "layout": ""}',
                '{"version": 7, "layout": "", "cut": [[0]]}', '{"version": 7, "layout": "", "cut": [[0, "64"]]}',
                '{"version": 7, "layout": "", "cut": [[-1, 64]]}', '{"version": 7, "layout": "", "cut": [[0, 1.5]]}',
                '{"version": 7, "layout": "", "cut": ' + too_fine + '}']:
        with pytest.raises(ValueError):
            P.Header.decode(bad)


def test_the_packed_cut_sends_large_tensors_alone_and_packs_runs_of_small_ones():
    specs = ([TensorSpec(f"s{i}", (7,), "bfloat16") for i in range(5)] + [TensorSpec("big", (300,), "float32")]
             + [TensorSpec(f"t{i}", (3,), "float32") for i in range(4)] + [TensorSpec("big2", (1000,), "float32")])
    buckets = plan_buckets(specs, 1 << 20)  # bfloat16 bucket at 0 (70 bytes), float32 bucket at 128
    cut = cut_arena(buckets, 1024, 1000)
    # the run of bf16 tensors (padding after it left out), big alone in two parts, the run of four small
    # float32 tensors, big2 in four parts
    assert cut[:4] == [(0, 70), (128, 768), (768, 1328), (1328, 1376)] and len(cut) == 8 and cut[-1][1] == 5376
    check_cut(cut, buckets)
    fine = cut_arena(buckets, 16, 1000)  # a run cut finer than 64 bytes: its inner boundaries stay aligned
    assert fine[:2] == [(0, 64), (64, 70)] and all(a % 4 == 0 for a, _ in fine if a >= 128)
    check_cut(fine, buckets)
    check_cut([(0, 80), *cut[1:]], buckets)  # padding may travel
    for bad in (cut[:-1], [(0, 64), *cut[1:]], [(0, 200), *cut[1:]], [*cut[:-1], (4448, 6000)]):
        with pytest.raises(ValueError):  # a tensor left out, overlapping chunks, past the arena
            check_cut(bad, buckets)
    with pytest.raises(ValueError):
        cut_arena(buckets, 0, 1000)


def test_members_and_join_requests_round_trip_and_validate():
    ms = [P.Member("gen0", "a1"), P.Member("gen1", "b2")]
    assert P.decode_members(P.encode_members(ms).encode()) == ms
    assert P.decode_join(P.encode_join(ms[1])) == ms[1]
    assert ms[0].token == "gen0#a1"
    for bad in ['{"id": "", "nonce": "x"}', '{"id": "a#b", "nonce": "x"}', '{"id": "a/b", "nonce": "x"}',
                '{"id": 3, "nonce": "x"}', '["gen0", "x"]']:
        with pytest.raises(ValueError):
            P.decode_join(bad)
    with pytest.raises(ValueError):
        P.decode_members('[["gen0"]]')


def test_keys_are_distinct_per_epoch_push_and_member():
    keys = {P.header_key(0, 0), P.header_key(0, 1), P.header_key(1, 0), P.ack_key(0, 0, "gen0"),
            P.ack_key(0, 0, "gen1"), P.ack_key(0, 1, "gen0"), P.failed_key(0, 0), P.abort_key(0, 0),
            P.members_key(0), P.ready_key(0, "gen0"), P.go_key(0), P.admit_key(P.Member("gen0", "n"))}
    assert len(keys) == 12
    assert P.pg_prefix(2).startswith("e2/") and not P.pg_prefix(2).startswith(P.pg_prefix(1))


def test_merge_members_drops_replaces_in_place_and_appends():
    a, b, c = P.Member("gen0", "1"), P.Member("gen1", "1"), P.Member("gen2", "1")
    b2, d = P.Member("gen1", "2"), P.Member("gen3", "1")
    assert P.merge_members([a, b, c], {"gen2"}, []) == [a, b]
    # a restarted gen1 keeps its rank; a new id goes last
    assert P.merge_members([a, b, c], set(), [d, b2]) == [a, b2, c, d]
    # dropped, then back as a new incarnation in the same boundary: appended
    assert P.merge_members([a, b, c], {"gen1"}, [b2]) == [a, c, b2]
    assert P.merge_members([], set(), [c, a]) == [c, a]


def test_arena_offsets_are_aligned_and_views_exact():
    specs = [TensorSpec("a", (3,), "float32"), TensorSpec("b", (5,), "bfloat16"), TensorSpec("c", (2, 2), "int64"),
             TensorSpec("big", (40,), "float32"), TensorSpec("s", (), "float64")]
    buckets = plan_buckets(specs, 64)
    offsets, total = arena_offsets(buckets)
    assert all(o % ALIGN == 0 for o in offsets) and total >= offsets[-1] + buckets[-1].nbytes
    assert all(o2 >= o1 + b.nbytes for o1, o2, b in zip(offsets, offsets[1:], buckets))
    arena = torch.zeros(total, dtype=torch.uint8)
    src = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.arange(5).to(torch.bfloat16),
           "c": torch.tensor([[2**40, -1], [3, 4]]), "big": torch.randn(40),
           "s": torch.tensor(2.5, dtype=torch.float64)}
    for off, b in zip(offsets, buckets):
        raw = arena[off:off + b.nbytes]
        for e in b.entries:  # write as the sender's packing does
            flat = raw.view({"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64,
                             "float64": torch.float64}[b.dtype])
            flat[e.offset:e.offset + e.numel].copy_(src[e.name].reshape(-1))
    got = {n: t for off, b in zip(offsets, buckets) for n, t in named_views(arena[off:off + b.nbytes], b)}
    assert set(got) == set(src)
    for n, t in src.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n], t), n
    assert got["s"].shape == ()


def test_as_bytes_is_a_view():
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = as_bytes(t)
    assert b.dtype == torch.uint8 and b.numel() == 24 and b.data_ptr() == t.data_ptr()


def test_in_place_chunk_sends_flat_backed_pieces_from_their_storage():
    specs = [TensorSpec("a", (4, 5), "float32"), TensorSpec("b", (10,), "float32")]
    buckets = plan_buckets(specs, 1 << 20)
    [pieces] = chunk_pieces(buckets, [(0, 120)])
    flat = torch.arange(100, dtype=torch.float32)
    a, b = flat[10:30].view(4, 5), flat[30:40]
    data = in_place_chunk(pieces, [a, b], 120)
    assert data is not None and data.data_ptr() == a.data_ptr() and data.numel() == 120
    assert torch.equal(data.view(torch.float32), flat[10:40])
    assert in_place_chunk(pieces, [a, flat[31:41]], 120) is None                    # a gap
    assert in_place_chunk(pieces, [flat[30:50].view(4, 5), flat[10:20]], 120) is None  # wrong order
    assert in_place_chunk(pieces, [torch.randn(4, 5), torch.randn(10)], 120) is None   # separate tensors
    assert in_place_chunk(pieces, [flat[:40].view(5, 8).t().contiguous().view(4, 10)[:, :5], b], 120) is None
    tail = torch.arange(30, dtype=torch.float32)
    assert in_place_chunk(pieces, [tail[0:20].view(4, 5), tail[20:30]], 120) is not None  # ends at the end
    assert in_place_chunk(pieces, [tail[5:25].view(4, 5), tail[25:35]], 120) is None  # past the storage


def test_chunks_cut_the_arena_alike_for_any_tensor_sizes():
    assert chunk_ranges(0, 64) == []
    assert chunk_ranges(1000, 4096) == [(0, 1000)]
    got = chunk_ranges(10_000, 3000)
    assert len(got) == 4 and got[0] == (0, 2560) and got[-1][1] == 10_000
    assert all(a % ALIGN == 0 for a, _ in got) and all(b == c for (_, b), (c, _) in zip(got, got[1:]))
    with pytest.raises(ValueError):
        chunk_ranges(10, 0)
    # one large tensor split over chunks, small ones packed, two dtypes: the pieces tile every tensor once
    specs = [TensorSpec("big", (300,), "float32")] + [TensorSpec(f"s{i}", (7,), "bfloat16") for i in range(9)]
    buckets = plan_buckets(specs, 256)
    offsets, total = arena_offsets(buckets)
    chunks = chunk_ranges(total, 256)
    pieces = chunk_pieces(buckets, chunks)
    assert len(chunks) > 3 and sum(len(ps) for ps in pieces) > len(specs)
    covered: dict[int, list[tuple[int, int]]] = {}
    for (start, end), ps in zip(chunks, pieces):
        for p in ps:
            size = 4 if p.dtype == "float32" else 2
            assert 0 <= p.at and p.at + (p.stop - p.start) * size <= end - start
            covered.setdefault(p.index, []).append((p.start, p.stop))
    numels = [e.numel for b in buckets for e in b.entries]
    for i, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == numels[i] and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(covered) == len(specs)
    assert layout_digest(buckets) == layout_digest(plan_buckets(specs, 256))
    assert layout_digest(buckets) != layout_digest(plan_buckets(specs, 64))  # other buckets


def test_auto_bucket_bytes_is_bounded():
    assert auto_bucket_bytes(1 << 20) == 4 << 20
    assert auto_bucket_bytes(400 << 20) == 50 << 20
    assert auto_bucket_bytes(10 << 30) == 64 << 20


def test_push_error_names_culprits_not_victims():
    err = PushError(5, 2, ["gen2"], {"gen1": "error: RuntimeError: load failed"}, "SyncTimeout: ...", ["gen0"])
    assert err.failed_members == ["gen2", "gen1"]
    text = str(err)
    assert "version 5" in text and "gen2" in text and "gen1 reported error" in text and "gen0" not in text


class FakeWork:
    """Completes at ``done_at`` (monotonic), optionally with an error; wait(timeout) behaves like c10d's."""

    def __init__(self, done_at: float, error: Exception | None = None) -> None:
        self.done_at, self.error = done_at, error
        self.waits = 0

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        left = self.done_at - time.monotonic()
        if timeout is not None and left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        time.sleep(max(left, 0))
        if self.error:
            raise self.error
        return True


def test_wait_work_completes_times_out_aborts_and_surfaces_errors():
    now = time.monotonic()
    wait_work(FakeWork(now + 0.05), now + 1.0, "op", slice_s=0.02)
    never = FakeWork(now + 60)
    with pytest.raises(SyncTimeout, match="op"):
        wait_work(never, time.monotonic() + 0.2, "op", slice_s=0.05)
    assert 1 <= never.waits <= 5, "each wait must be one slice, and the deadline must end the slices"
    calls = []

    def abort():
        calls.append(1)
        return "the sender aborted" if len(calls) >= 2 else None

    with pytest.raises(Aborted, match="the sender aborted"):
        wait_work(FakeWork(now + 60), time.monotonic() + 5.0, "op", abort, slice_s=0.02)
    with pytest.raises(SyncError, match="Connection reset"):
        wait_work(FakeWork(time.monotonic(), RuntimeError("Connection reset by peer")), time.monotonic() + 1.0, "op")


def test_flatten_params_keeps_values_and_parameters_and_makes_every_bucket_zero_copy():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[2].to(torch.bfloat16)
    named = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    specs = [TensorSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in named.items()]
    buckets = plan_buckets(specs, 64)
    assert any(len(b.entries) > 1 for b in buckets) and len({b.dtype for b in buckets}) == 2
    arena = flatten_params(named, buckets)
    assert all(p is named[n] for n, p in model.named_parameters())  # same Parameter objects
    assert all(torch.equal(before[n], p) and p.dtype == before[n].dtype for n, p in named.items())
    chunks = chunk_ranges(arena_offsets(buckets)[1], 128)
    names = [e.name for b in buckets for e in b.entries]
    assert len(chunks) > 1
    for (start, end), ps in zip(chunks, chunk_pieces(buckets, chunks)):
        data = in_place_chunk(ps, [named[names[p.index]] for p in ps], end - start)
        assert data is not None and data.data_ptr() == arena.data_ptr() + start
    assert arena.dtype == torch.uint8 and named["0.weight"].untyped_storage().data_ptr() == arena.data_ptr()
    model[0](torch.randn(2, 8)).sum().backward()  # still trainable
    assert named["0.weight"].grad.shape == (4, 8)


def test_every_tp_worker_is_a_member_of_its_own() -> None:
    from async_rlhf.sync.protocol import encode_join, tp_member_id, tp_member_ids

    assert tp_member_ids("gen0", 1) == ["gen0"]  # no TP: the generator's id, as always
    assert tp_member_ids("gen3", 2) == ["gen3.tp0", "gen3.tp1"]
    for m in tp_member_ids("gen3", 4):
        assert P.decode_join(encode_join(P.Member(m, "n"))).id == m  # valid ids on the wire
    with pytest.raises(ValueError):
        tp_member_id("gen0", 2, 2)


def test_an_engine_swaps_only_a_version_all_its_workers_hold() -> None:
    from async_rlhf.generator.worker_ext import common_staged

    assert common_staged([4]) == 4
    assert common_staged([4, None]) is None  # one TP worker still receiving
    assert common_staged([5, 4]) == 4
    assert common_staged([5, -1]) == -1  # a failed fetch on any worker is reported
    assert common_staged([]) is None
