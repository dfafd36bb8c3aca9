"""ZeRO-3: the weight push and the saved policy gather the model a window at a time, never all of it at once.

Under ZeRO-3 each learner rank holds 1/N of every parameter; sending or saving the model needs the full
tensors, and gathering all of them at once (one ``GatheredParameters`` over the model) puts the whole model
on every rank: out of memory on exactly the models that need ZeRO-3. So both go window by window::

    layout (arena order) --cut--> chunks c0 c1 c2 ... (the sender's broadcasts, packed into its slots)
    windows: runs of consecutive chunks whose tensors hold at most learner.zero3_gather_mb together
             (one larger tensor, or one chunk needing more: a window of its own)

    every learner rank, per window, in the same order (each gather is a collective):
        GatheredParameters(the window's parameters, modifier_rank=None)
          rank 0: pack the window's chunks into the sender's slots, post their broadcasts
        leave the context: the full tensors are released before the next window is gathered
    rank 0, after a pass: the outcome to every learner rank (one broadcast on the learners' group):
        DONE | AGAIN (a member failed: the push is repeated on the rebuilt group, another pass) | FAILED
    a pass that fails half-way still gathers its remaining windows on rank 0, so the collectives stay matched.

Saving (:func:`save_hf_windowed`) gathers windows of parameters in module order and writes one safetensors
shard per window from rank 0 (Hugging Face's sharded layout with its index), so neither a rank's device nor
rank 0's host memory ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from async_rlhf.sync.layout import DTYPE_BYTES, Bucket
from async_rlhf.sync.tensors import Piece, arena_offsets, chunk_pieces, cut_arena

log = logging.getLogger(__name__)

DONE, AGAIN, FAILED = 0, 1, 2
"""Outcomes of one pass of a ZeRO-3 push, as rank 0 tells the other learner ranks."""

Gather = Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager]
"""Makes the context that holds a list of parameters gathered (DeepSpeed's by default; tests record it)."""


def deepspeed_gather(params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager:
    """DeepSpeed's maintained API: gather these parameters on every rank (a collective), release them on exit."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def full_numel(p: torch.Tensor) -> int:
    """Elements of a parameter's full tensor (a ZeRO-3 parameter keeps its full size in ``ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))


@dataclass(frozen=True)
class Window:
    """Chunks ``first..end-1`` of the push, and the tensors (layout indices) they need gathered."""

    first: int
    end: int
    tensors: tuple[int, ...]
    nbytes: int


def push_cut(buckets: list[Bucket], gather_bytes: int) -> list[tuple[int, int]]:
    """The broadcasts of a ZeRO-3 push (pure, the same on every rank): the sender's packed cut, with chunks of at
    most a quarter of ``gather_bytes`` so that a window holds several of them."""
    from async_rlhf.sync.layout import ALIGN, auto_chunk_bytes
    from async_rlhf.sync.send_staging import OWN_BYTES

    _, total = arena_offsets(buckets)
    chunk = min(auto_chunk_bytes(total), max(ALIGN, gather_bytes // 4))
    return cut_arena(buckets, chunk, min(OWN_BYTES, chunk)) if total else []


def plan_windows(pieces: Sequence[Sequence[Piece]], tensor_bytes: Sequence[int], gather_bytes: int) -> list[Window]:
    """Consecutive chunks grouped so that the tensors each group needs hold at most ``gather_bytes`` (a chunk
    that alone needs more is a window of its own: a tensor is gathered whole, and the parts of one large tensor
    stay in one window). Pure."""
    if gather_bytes <= 0:
        raise ValueError("gather_bytes must be positive")
    windows: list[Window] = []
    first, need = 0, set[int]()
    for c, chunk in enumerate(pieces):
        own = {p.index for p in chunk}
        if need and not own <= need and sum(tensor_bytes[i] for i in need | own) > gather_bytes:
            windows.append(Window(first, c, tuple(sorted(need)), sum(tensor_bytes[i] for i in need)))
            first, need = c, set()
        need |= own
    if first < len(pieces):
        windows.append(Window(first, len(pieces), tuple(sorted(need)), sum(tensor_bytes[i] for i in need)))
    return windows


class WindowedGather:
    """One ZeRO-3 push's parameters, gathered a window at a time while the sender packs its chunks.

    The sender calls :meth:`before_chunk` for each chunk, in order, before packing it; the learner ends every
    pass with :meth:`end_pass`, which gathers the windows the sender never reached (it failed early) and tells
    the other ranks what comes next. Ranks other than 0 run :meth:`follow`."""

    def __init__(self, params: list[torch.nn.Parameter], shapes: list[torch.Size], windows: list[Window],
                 cut: list[tuple[int, int]], device: torch.device | str = "cpu", gather: Gather = deepspeed_gather,
                 tell: Callable[[int], int] | None = None) -> None:
        """``params``/``shapes``: every tensor of the layout in its order and its full shape; ``tell(outcome)``
        broadcasts rank 0's outcome and returns it on every rank (default: on the learners' default group)."""
        self.params, self.shapes, self.windows, self.cut = params, shapes, windows, cut
        self.device, self.gather = torch.device(device), gather
        self.tell = tell or self._broadcast
        self._window_of = [w_i for w_i, w in enumerate(windows) for _ in range(w.first, w.end)]
        self._open: tuple[int, contextlib.AbstractContextManager] | None = None
        self._next = 0  # the first window not gathered yet in this pass

    # -- rank 0, driven by the sender -----------------------------------------------------------------
    def before_chunk(self, c: int) -> None:
        """Make chunk ``c``'s tensors full: release the window before it and gather the next ones in order."""
        w = self._window_of[c]
        if self._open is not None and self._open[0] == w:
            return
        self._close()
        while self._next < w:  # never skipped: every rank gathers every window (the sender asks for each chunk)
            self._visit(self._next)
        self._enter(w)

    def end_pass(self, outcome: int) -> None:
        """Release the open window, gather the ones this pass never reached, and tell every rank ``outcome``."""
        try:
            self._close()
            while self._next < len(self.windows):
                self._visit(self._next)
        finally:
            self._next = 0
            self.tell(outcome)

    # -- the other ranks ------------------------------------------------------------------------------
    def follow(self) -> None:
        """What ranks other than 0 do for one push: gather every window in order, pass after pass, until rank 0
        says the push is done; raises if it failed there."""
        while True:
            for w in range(len(self.windows)):
                self._visit(w)
            outcome = self.tell(DONE)
            if outcome == DONE:
                return
            if outcome == FAILED:
                raise RuntimeError("the weight push failed on learner rank 0 (see its error)")

    # -- windows ---------------------------------------------------------------------------------------
    def _enter(self, w: int) -> None:
        ctx = self.gather([self.params[i] for i in self.windows[w].tensors])
        ctx.__enter__()
        self._open, self._next = (w, ctx), w + 1
        for i in self.windows[w].tensors:
            if self.params[i].shape != self.shapes[i]:
                self._close()
                raise ValueError(f"parameter {i} of the push layout is {tuple(self.params[i].shape)} once gathered, "
                                 f"the layout says {tuple(self.shapes[i])}: rebuild the layout")

    def _close(self) -> None:
        if self._open is None:
            return
        _, ctx = self._open
        self._open = None
        if self.device.type == "cuda":  # the slots' copies read the gathered memory: done before it is freed
            torch.cuda.current_stream(self.device).synchronize()
        ctx.__exit__(None, None, None)

    def _visit(self, w: int) -> None:
        with self.gather([self.params[i] for i in self.windows[w].tensors]):
            pass
        self._next = max(self._next, w + 1)

    def _broadcast(self, outcome: int) -> int:
        import torch.distributed as dist

        t = torch.tensor([outcome], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=0)
        return int(t.item())


def windowed_gather(module: torch.nn.Module, buckets: list[Bucket], gather_bytes: int,
                    device: torch.device | str = "cpu", gather: Gather = deepspeed_gather) -> WindowedGather:
    """The :class:`WindowedGather` of a ZeRO-3 module for this push layout (the same on every rank)."""
    named = dict(module.named_parameters())
    entries = [(e.name, b.dtype) for b in buckets for e in b.entries]
    missing = [n for n, _ in entries if n not in named]
    if missing:
        raise ValueError(f"parameters {missing[:3]} of the push layout are not in the model: rebuild the layout")
    cut = push_cut(buckets, gather_bytes)
    sizes = [full_numel(named[n]) * DTYPE_BYTES[dt] for n, dt in entries]
    windows = plan_windows(chunk_pieces(buckets, cut), sizes, gather_bytes)
    shapes = [torch.Size(e.shape) for b in buckets for e in b.entries]
    return WindowedGather([named[n] for n, _ in entries], shapes, windows, cut, device, gather)


def save_windows(module: torch.nn.Module, gather_bytes: int) -> list[list[str]]:
    """Parameter names in module order, cut into runs of at most ``gather_bytes`` (a larger one alone)."""
    out: list[list[str]] = []
    size = 0
    for name, p in module.named_parameters():
        n = full_numel(p) * p.element_size()
        if out and out[-1] and size + n <= gather_bytes:
            out[-1].append(name)
            size += n
        else:
            out.append([name])
            size = n
    return out


def gathered_state(module: torch.nn.Module, gather_bytes: int, gather: Gather = deepspeed_gather,
                   copy: bool = True) -> Iterator[dict[str, torch.Tensor]]:
    """The module's parameters as CPU copies, one window at a time (collective: every rank iterates all of it;
    ``copy=False``: a rank that only takes part in the gathers, yielding nothing of them)."""
    named = dict(module.named_parameters())
    for names in save_windows(module, gather_bytes):
        with gather([named[n] for n in names]):
            yield {n: named[n].detach().to("cpu", copy=True).contiguous() for n in names} if copy else {}


def save_hf_windowed(module: Any, out_dir: str | Path, gather_bytes: int, write: bool,
                     gather: Gather = deepspeed_gather) -> None:
    """Save a ZeRO-3 Hugging Face model as sharded safetensors, one shard per window (collective; only the rank
    with ``write`` writes). Persistent buffers go in the first shard; a tied output embedding is left out as
    ``save_pretrained`` leaves it (``from_pretrained`` ties it again)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    names = save_windows(module, gather_bytes)
    buffers = {n: t.detach().to("cpu", copy=True) for n, t in module.state_dict(keep_vars=True).items()
               if not isinstance(t, torch.nn.Parameter)}  # persistent buffers only (state_dict's rule)
    weight_map: dict[str, str] = {}
    total = 0
    if write:
        out.mkdir(parents=True, exist_ok=True)
    for i, shard in enumerate(gathered_state(module, gather_bytes, gather, copy=write)):
        if not write:
            continue
        if i == 0:
            shard = {**buffers, **shard}
        fname = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    if not write:
        return
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    dtype = next(module.parameters()).dtype
    module.config.dtype = str(dtype).removeprefix("torch.")
    module.config.architectures = [type(module).__name__]
    module.config.save_pretrained(out)
    if getattr(module, "generation_config", None) is not None and module.can_generate():
        module.generation_config.save_pretrained(out)
