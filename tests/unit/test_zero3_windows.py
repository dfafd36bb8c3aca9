"""The windows of a ZeRO-3 push (learner/zero3.py, pure): consecutive chunks, each window's tensors within the
bound unless one chunk alone needs more, the parts of one large tensor in one window, every chunk's tensors in
its window, and the same plan from the same layout (every learner rank computes it)."""

import pytest

from async_rlhf.learner.zero3 import plan_windows, push_cut
from async_rlhf.sync.layout import DTYPE_BYTES, TensorSpec, plan_buckets
from async_rlhf.sync.tensors import chunk_pieces


def layout(sizes: list[int]):
    specs = [TensorSpec(f"t{i}", (n,), "float32") for i, n in enumerate(sizes)]
    return plan_buckets(specs, 4096), [n * DTYPE_BYTES["float32"] for n in sizes]


@pytest.mark.parametrize("gather", [1024, 4096, 1 << 20])
def test_windows_are_bounded_consecutive_and_cover_every_chunk(gather: int) -> None:
    buckets, nbytes = layout([40, 100, 30, 900, 20, 60, 2000, 10, 10, 300])  # 2000 floats: 8000 bytes, alone
    cut = push_cut(buckets, gather)
    pieces = chunk_pieces(buckets, cut)
    windows = plan_windows(pieces, nbytes, gather)
    assert windows == plan_windows(chunk_pieces(buckets, push_cut(buckets, gather)), nbytes, gather)
    assert windows[0].first == 0 and windows[-1].end == len(cut)
    assert all(a.end == b.first for a, b in zip(windows, windows[1:]))
    for w in windows:
        need = {p.index for c in range(w.first, w.end) for p in pieces[c]}
        assert need == set(w.tensors) and w.nbytes == sum(nbytes[i] for i in need)
        alone = w.end - w.first == 1 or len(need) == 1
        assert w.nbytes <= gather or alone, (w, gather)
    big = [w for w in windows if 6 in w.tensors]
    assert len(big) == 1  # the parts of tensor 6 are never gathered twice
    if gather == 1 << 20:
        assert len(windows) == 1
    else:
        assert len(windows) >= 3


def test_a_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="gather_bytes must be positive"):
        plan_windows([], [], 0)
