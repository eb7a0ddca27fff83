"""Where the blocks of a packed training sequence sit, and the training mask they imply (training.md).

`train_layout` places a block of B slots at each anchor; `TrainLayout` answers, for the attention kernels of
model/modeling_dflash.py, which context tokens each block slot may see (its own document, strictly before its
anchor, within the sliding window), in which runs the split attention computes them, and the flex block mask;
`dense_training_mask` writes the same mask out densely (the reference the kernels are tested against).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class GridRuns(NamedTuple):
    """The split runs side by side in one padded grid of `runs` x `per_run` blocks against `span` context tokens."""

    rows: torch.Tensor  # [N] long: block n's row r * per_run + j in the grid
    ctx_index: torch.Tensor  # [runs, span] long: the packed index of run r's l-th context token (clamped)
    ctx_ok: torch.Tensor  # [N, 1, B, span] bool: block n's slot k may attend to it
    runs: int
    per_run: int
    span: int
    run_pairs: int  # (block, context token) pairs the runs score one by one: sum of blocks x span per run


@dataclass
class TrainLayout:
    """Where the blocks of a packed sequence sit, shared by every layer of one forward.

    anchors[n]      index into the packed context of block n's first token
    doc_start[n]    index of the first token of block n's document
    ctx_positions   [T] absolute (in-document) position of each context token
    block_positions [N, B] absolute positions of each block slot
    chunk_blocks    the split attention's unit of work: at most this many blocks at a time
    ctx_pad         flex: the context length every micro-batch of the run is padded to (model/flex.py)
    grid            split attention's grid, built beforehand (`padded_runs(per_run=...)`): taken as it is, without the
                    choice between the grid and the runs one by one that split attention makes from host sizes
    """

    anchors: torch.Tensor
    doc_start: torch.Tensor
    ctx_positions: torch.Tensor
    block_positions: torch.Tensor
    chunk_blocks: int = 32
    ctx_pad: int | None = None
    grid: GridRuns | None = None
    cache: dict = field(default_factory=dict)

    def context_allowed(self, window: int | None, lo: int = 0, hi: int | None = None, c0: int = 0,
                        c1: int | None = None) -> torch.Tensor:
        """[n, 1, B, c1-c0] bool: block lo+n, slot k may attend to context token c0+t."""
        hi = self.anchors.numel() if hi is None else hi
        c1 = self.ctx_positions.numel() if c1 is None else c1
        key = ("ctx", window, lo, hi, c0, c1)
        if key not in self.cache:
            t = torch.arange(c0, c1, device=self.anchors.device)
            allowed = (t[None, :] >= self.doc_start[lo:hi, None]) & (t[None, :] < self.anchors[lo:hi, None])
            allowed = allowed[:, None, :].expand(-1, self.block_positions.shape[1], -1)
            if window is not None:
                dist = self.block_positions[lo:hi, :, None] - self.ctx_positions[None, None, c0:c1]
                allowed = allowed & (dist < window)
            self.cache[key] = allowed[:, None]
        return self.cache[key]

    def segments(self) -> list[tuple[int, int, int, int]]:
        """(lo, hi, c0, c1): runs of at most `chunk_blocks` consecutive blocks of one document and
        the context span [c0, c1) they can see (document start .. their last anchor). Blocks
        never see other documents or context at or after their anchor, so attention is computed
        per run against that span only, not against the whole packed context."""
        if "segments" not in self.cache:
            out, lo = [], 0
            starts = self.doc_start.tolist()
            anchors = self.anchors.tolist()
            step = max(1, int(self.chunk_blocks))
            for i in range(1, len(starts) + 1):
                if i == len(starts) or starts[i] != starts[lo]:
                    for a in range(lo, i, step):
                        b = min(i, a + step)
                        out.append((a, b, starts[lo], max(anchors[a:b])))
                    lo = i
            self.cache["segments"] = out
        return self.cache["segments"]

    def flex_mask(self, window: int | None):
        """The flex BlockMask of this layout (built once, on the layout's device, shared by layers)."""
        key = ("flex", window)
        if key not in self.cache:
            from dflash_train.model.flex import training_block_mask

            self.cache[key] = training_block_mask(self.anchors, self.doc_start, self.ctx_positions,
                                                  self.block_positions, window, self.ctx_pad)
        return self.cache[key]

    def grid_size(self) -> tuple[int, int, int, int]:
        """(runs, blocks a run, context span, run pairs) of the padded grid `padded_runs` builds, from the host's
        runs alone: what split attention weighs before it builds anything. run pairs: the (block, context token)
        pairs the runs score one by one, sum of blocks x span per run."""
        if "grid_size" not in self.cache:
            runs = self.segments()
            self.cache["grid_size"] = (len(runs), max((hi - lo for lo, hi, _, _ in runs), default=0),
                                       max((c1 - c0 for _, _, c0, c1 in runs), default=0),
                                       sum((hi - lo) * (c1 - c0) for lo, hi, c0, c1 in runs))
        return self.cache["grid_size"]

    def padded_runs(self, window: int | None, bucket: bool = False, per_run: int | None = None,
                    min_runs: int = 0) -> GridRuns:
        """The split runs side by side in one padded grid, so that attention over all of them is a few batched
        ops (split attention's `_attend_grid`). Built once from the host's runs, shared by every layer. bucket:
        the grid's runs rounded up to a multiple of 4 and its blocks a run and span to `row_buckets.rows`, so
        the batched matmuls meet a few shapes in a run (CPU half precision: oneDNN compiles one per shape); the
        added runs, rows and context columns are padding that no block reads or may attend to. per_run: every
        run padded to this many blocks (at least the longest run's) instead of to the longest run; min_runs:
        at least this many runs."""
        key = ("padded", window, bucket) + ((per_run, min_runs) if per_run is not None or min_runs else ())
        if key not in self.cache:
            runs = self.segments()
            dev = self.anchors.device
            n_runs, grid_p, grid_l, run_pairs = self.grid_size()
            if bucket and runs:
                from dflash_train.model.row_buckets import rows as bucket_rows

                n_runs, grid_p, grid_l = -(-n_runs // 4) * 4, bucket_rows(grid_p), bucket_rows(max(1, grid_l))
            if per_run is not None:
                grid_p = max(grid_p, per_run)
            n_runs = max(n_runs, min_runs) if runs else n_runs
            if not runs:  # no blocks: nothing to attend (split attention then has no run either)
                empty = torch.zeros(0, dtype=torch.long, device=dev)
                self.cache[key] = GridRuns(empty, empty[:, None], torch.zeros(0, 1, 1, 0, dtype=torch.bool, device=dev),
                                           0, 0, 0, 0)
                return self.cache[key]
            grid_l = max(1, grid_l)
            rows = torch.tensor([r * grid_p + j for r, (lo, hi, _, _) in enumerate(runs) for j in range(hi - lo)],
                                device=dev)
            run_of = torch.tensor([r for r, (lo, hi, _, _) in enumerate(runs) for _ in range(lo, hi)], device=dev)
            starts = [c0 for _, _, c0, _ in runs] + [0] * (n_runs - len(runs))  # added runs: read from 0, unused
            t = torch.tensor(starts, device=dev)[:, None] + torch.arange(grid_l, device=dev)
            ctx_index = t.clamp(max=self.ctx_positions.numel() - 1)
            # a run's context starts at its document's start: before the anchor is all a block may see there
            ok = (t[run_of] < self.anchors[:, None])[:, None, :].expand(-1, self.block_positions.shape[1], -1)
            if window is not None:
                dist = self.block_positions[:, :, None] - self.ctx_positions[ctx_index[run_of]][:, None, :]
                ok = ok & (dist < window)
            self.cache[key] = GridRuns(rows, ctx_index, ok[:, None], n_runs, grid_p, grid_l, run_pairs)
        return self.cache[key]

    def to(self, device: torch.device) -> TrainLayout:
        """This layout on `device`. The split runs are computed here, from the host copy, so the step
        never reads layout values back from the device; host tensors go through pinned memory."""
        if self.anchors.device == torch.device(device):
            return self
        from dflash_train.data.packing import to_device

        self.segments()
        out = TrainLayout(*(to_device(t, device) for t in (self.anchors, self.doc_start, self.ctx_positions,
                                                             self.block_positions)), chunk_blocks=self.chunk_blocks,
                          ctx_pad=self.ctx_pad)
        if self.grid is not None:
            out.grid = GridRuns(*(to_device(x, device) if isinstance(x, torch.Tensor) else x for x in self.grid))
        out.cache["segments"] = self.cache["segments"]
        return out

    def block_allowed(self, window: int | None) -> torch.Tensor | None:
        """[B, B] bool, or None for full bidirectional attention inside the block."""
        if window is None:
            return None
        b = self.block_positions.shape[1]
        return torch.ones(b, b, dtype=torch.bool, device=self.anchors.device).tril()


def dense_training_mask(layout: TrainLayout, window: int | None) -> torch.Tensor:
    """[N*B, T + N*B] bool: the training mask of training.md, written out densely."""
    n, b = layout.block_positions.shape
    ctx = layout.context_allowed(window)[:, 0].reshape(n * b, -1)
    blk_id = torch.arange(n * b, device=ctx.device) // b
    same = blk_id[:, None] == blk_id[None, :]
    if window is not None:
        slot = torch.arange(n * b, device=ctx.device) % b
        same = same & (slot[None, :] <= slot[:, None])
    return torch.cat([ctx, same], dim=-1)


def train_layout(anchors: torch.Tensor, doc_start: torch.Tensor, ctx_positions: torch.Tensor,
                 block_size: int, chunk_blocks: int = 32, ctx_pad: int | None = None) -> TrainLayout:
    """Layout for blocks at `anchors` of a packed sequence (ctx_positions: in-document positions)."""
    offsets = torch.arange(block_size, device=anchors.device)
    block_positions = ctx_positions[anchors][:, None] + offsets
    return TrainLayout(anchors=anchors, doc_start=doc_start, ctx_positions=ctx_positions,
                       block_positions=block_positions, chunk_blocks=chunk_blocks, ctx_pad=ctx_pad)
