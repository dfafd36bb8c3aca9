"""Chunk staging of the weight push (learner rank 0): how one bucket layout's arena goes out as broadcasts.

Kept apart from :mod:`async_rlhf.sync.sender`, which owns membership, epochs and the protocol; this module
knows none of that. For one layout it decides the push's *cut* (its broadcasts, see
:mod:`async_rlhf.sync.tensors`), finds for each chunk whether its bytes already lie in parameter memory (then
they are sent from there, no copy) and otherwise packs the chunk's pieces into a packing slot on the
transport's device (``depth`` slots, reused by every push). The sender announces :attr:`SendStaging.chunks`
in the push header and opens a new epoch when the cut changes within one (members pre-post for the old cut).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from async_rlhf.sync.layout import Bucket, auto_chunk_bytes, chunk_ranges
from async_rlhf.sync.tensors import TORCH_DTYPES, arena_offsets, chunk_pieces, cut_arena, in_place_chunk
from async_rlhf.sync.transport import Transport

__all__ = ["OWN_BYTES", "SendStaging", "Streamed"]

_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")
OWN_BYTES = 2 << 20
"""A tensor this large goes out as a broadcast of its own, from its storage, when the push is not one flat
buffer: on CPU, packing 2 MiB costs about as much as the extra broadcast's overhead (0.1-0.3 ms)."""


def _picker(indices: list[int]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """A function returning the list of ``tensors[i] for i in indices``, by one C-level call."""
    if len(indices) < 2:  # itemgetter returns a bare item for one index and takes none for zero
        return lambda tensors: [tensors[i] for i in indices]
    get = operator.itemgetter(*indices)
    return lambda tensors: list(get(tensors))


class Streamed(Protocol):
    """Parameters full only a window at a time (ZeRO-3, learner/zero3.py); ``cut``: the push's broadcasts."""

    cut: list[tuple[int, int]]

    def before_chunk(self, c: int) -> None: ...


class SendStaging:
    """One layout's cut, packing slots and their views. The sender builds a new one at each ``use_layout``.
    Not thread-safe (the sender's push thread only)."""

    def __init__(self, buckets: list[Bucket], transport: Transport, depth: int, chunk_bytes: int | None,
                 own_bytes: int) -> None:
        """``chunk_bytes``: size of one packed broadcast, or None: a push whose bytes all lie in parameter
        memory is one broadcast, else the cut of :func:`cut_arena` (``own_bytes``: a tensor this large is a
        broadcast of its own). ``depth``: packing slots (chunk c is packed into slot c % depth)."""
        _, total = arena_offsets(buckets)
        self.buckets, self.transport, self.depth, self.chunk_bytes = buckets, transport, depth, chunk_bytes
        self._total = total
        self.nbytes = float(sum(b.nbytes for b in buckets))
        self._whole = chunk_pieces(buckets, [(0, total)])[0] if total else []
        self._names = [e.name for b in buckets for e in b.entries]
        self._shapes = [(torch.Size(e.shape), TORCH_DTYPES[b.dtype]) for b in buckets for e in b.entries]
        self._flat: tuple[list[int], list[torch.Tensor | None]] | None = None
        if chunk_bytes:  # as asked: equal chunks, whatever the tensors
            self._packed_cut = chunk_ranges(total, chunk_bytes)
        else:
            self._packed_cut = cut_arena(buckets, auto_chunk_bytes(total), own_bytes) if total else []
        self.chunks: list[tuple[int, int]] = []
        """The current cut: one (start, end) byte range of the arena per broadcast."""
        self.slots: list[torch.Tensor] = []
        """The packing slots allocated so far (on the transport's device)."""
        self._cut(self._packed_cut)

    def _cut(self, chunks: list[tuple[int, int]]) -> None:
        """Send the arena as these broadcasts (the push header tells members how it is cut)."""
        if chunks == self.chunks:
            return
        self.chunks = chunks
        self._pieces = chunk_pieces(self.buckets, self.chunks)
        # per chunk, its tensors fetched by one C-level call, and the pieces that are parts of a tensor (at most
        # the first and the last): the packing loop then does nothing per whole tensor in Python
        self._pick = [_picker([p.index for p in pieces]) for pieces in self._pieces]
        self._parts = [[(i, p) for i, p in enumerate(pieces) if not p.whole] for pieces in self._pieces]
        self._slot_bytes = max((end - start for start, end in self.chunks), default=0)
        self.slots = []
        self._dst: dict[int, list[torch.Tensor]] = {}

    def _slot(self, slot: int) -> torch.Tensor:
        """Packing slot bytes (allocated on first use, reused by every push)."""
        while len(self.slots) <= slot:
            self.slots.append(self.transport.empty(self._slot_bytes))
        return self.slots[slot]

    def slot_of(self, c: int) -> int:
        """The packing slot of chunk c."""
        return c % self.depth

    def _destinations(self, c: int) -> list[torch.Tensor]:
        """Typed views of chunk c's pieces in its slot (computed once per cut)."""
        if c not in self._dst:
            raw = self._slot(self.slot_of(c))
            views = []
            for p in self._pieces[c]:
                n = (p.stop - p.start) * TORCH_DTYPES[p.dtype].itemsize
                view = raw[p.at:p.at + n].view(TORCH_DTYPES[p.dtype])
                views.append(view.view(self._shapes[p.index][0]) if p.whole else view)
            self._dst[c] = views
        return self._dst[c]

    def sources(self, params: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Every tensor of the layout in order, checked against it, and per chunk its bytes where they lie in
        parameter memory (sent as they are) or None (packed). May change :attr:`chunks`.

        Per-tensor Python is what separates a push of many small tensors from one of a few large ones, so the
        checks are C-level loops, and where every chunk lies in parameter memory (parameters kept flat) the
        chunks' views are kept and reused while the tensors stay where they were (their addresses are compared;
        the views keep that storage alive, so an address cannot be reused by another one meanwhile)."""
        tensors = self._tensors(params)
        if list(map(_SHAPE_DTYPE, tensors)) != self._shapes:
            for name, (shape, dtype), t in zip(self._names, self._shapes, tensors):
                if t.shape != shape or t.dtype != dtype:
                    raise ValueError(f"parameter {name} is {tuple(t.shape)} {t.dtype}, the layout says "
                                     f"{tuple(shape)} {dtype}: rebuild the layout")
        ptrs = list(map(torch.Tensor.data_ptr, tensors))
        if self._flat is not None and self._flat[0] == ptrs and all(map(torch.Tensor.is_contiguous, tensors)):
            # (contiguity too: a tensor re-pointed at a transposed view of itself keeps its address)
            return tensors, self._flat[1]
        whole = None
        if self.chunk_bytes is None and self._whole:  # the whole arena where it lies: one broadcast, as raw
            whole = self._on_device(in_place_chunk(self._whole, [tensors[p.index] for p in self._whole], self._total))
        if whole is not None:
            self._cut([(0, self._total)])
            sources: list[torch.Tensor | None] = [whole]
        else:  # large tensors from their storage, runs of small ones packed (see cut_arena)
            self._cut(self._packed_cut)
            sources = [self._on_device(in_place_chunk(pieces, pick(tensors), end - start))
                       for pieces, pick, (start, end) in zip(self._pieces, self._pick, self.chunks)]
        self._flat = (ptrs, sources) if all(src is not None for src in sources) else None
        return tensors, sources

    def streamed(self, params: Mapping[str, torch.Tensor], stream: Streamed) -> tuple[list[torch.Tensor], list[None]]:
        """ZeRO-3: the tensors are full one window at a time, during the push (``stream.before_chunk(c)`` gathers
        chunk c's, see learner/zero3.py): every chunk is packed, on the stream's cut."""
        tensors = self._tensors(params)
        self._flat = None
        self._cut(list(stream.cut))
        return tensors, [None] * len(self.chunks)

    def _on_device(self, chunk: torch.Tensor | None) -> torch.Tensor | None:
        """A chunk sent from parameter memory only if the transport takes it there (else None: packed into a
        slot on the transport's device, e.g. parameters on CPU under NCCL)."""
        return chunk if chunk is not None and self.transport.accepts(chunk) else None

    def _tensors(self, params: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        try:
            return list(map(params.__getitem__, self._names))
        except KeyError as exc:
            raise ValueError(f"parameter {exc} of the push layout is missing: rebuild the layout") from None

    def pieces(self, c: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Chunk c's pieces in parameter memory (of ``tensors``, from :meth:`sources` or :meth:`streamed`)."""
        srcs = self._pick[c](tensors)
        for i, p in self._parts[c]:
            srcs[i] = srcs[i].detach().reshape(-1)[p.start:p.stop]
        return srcs

    def pack(self, c: int, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Copy chunk c's ``pieces`` into its slot (one fused copy; the slot's previous chunk must be on the wire
        already); returns the chunk's bytes there, to broadcast."""
        torch._foreach_copy_(self._destinations(c), pieces)
        start, end = self.chunks[c]
        return self._slot(self.slot_of(c))[:end - start]
