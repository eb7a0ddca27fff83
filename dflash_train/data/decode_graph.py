"""The greedy loop's decode step as a CUDA graph recorded from the eager model call: no compiler.

Why: on a GPU the regeneration's decode step was `torch.compile`d (inductor, "reduce-overhead"), and what a
user's first run paid for it was the compile, not the decode: on a fresh H200 (304cfdf, docs/gpu.md) the first
pass over 512 rows took 103.5 s and the same pass once compiled 4.1 s; in `make demo-gpu` prepare + regenerate
took 125.5 s with cold compile caches and 68.0 s with warm ones. What the compiled step buys over an eager one
is mostly the CUDA graph: an eager SmolLM2 step is ~2,400 operator calls (30 layers), each a kernel launch from
Python, for a few microseconds of work each. Recording the eager call once per group and replaying it gives
the launches back without dynamo, AOT or Inductor: one eager step and one recording per group.

What makes the eager call recordable (tests/unit/data/test_decode_graph.py runs a step on the meta device under
an audit that stops at any host read or host tensor):
- nothing in a decode step reads the device from the host: the static cache counts its positions in a device
  tensor (transformers 5.17 and later), and transformers' masks skip their "no padding?" read of the mask while a
  stream records (`is_tracing`), as they do under compile;
- every input stays at one address: the token and position buffers here, the group's full-length mask, and the
  cache's tensors (`reset` zeroes them in place);
- nothing on the host changes from one step to the next: only caches whose every layer is transformers'
  `StaticLayer` are recorded (`recordable`); any other kind (sliding-window or hybrid layers keep host-side
  counters) takes the compiled step, as before.

A group's first decode step runs eager, on a side stream as recording needs (cuBLAS and the allocator set up
outside it), and is the group's real first step; the recording that follows runs nothing, so the cache is
where that step left it. Each later step copies its token and positions into the buffers and replays; the
logits it returns are overwritten by the next replay (`static_decode.greedy_decode` takes the argmax at once).
The graph and its memory pool go with the group. A recording that fails (an operation the installed
transformers adds that CUDA graphs refuse) does not end the regeneration: the step warns, naming the error,
and runs the group's other steps eager (`GraphedStep.failed`); `HFGenerator` gives the later groups the
compiled step. The tokens are the same either way up to the kernels' rounding: a replay runs the eager kernels.

Elsewhere than CUDA (the tests) `replay` runs the eager call on the same buffers, so the loop, the buffers and
the first-step logic are what a CPU tests.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace


def recordable(cache) -> str | None:
    """Why `cache` (a transformers StaticCache) cannot be recorded, or None: a layer that is not a plain
    `StaticLayer` may keep host-side state that a replay would not advance."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    if not layers:
        return f"{type(cache).__name__} has no list of layers to check"
    kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not StaticLayer})
    return f"cache layers of kind {', '.join(kinds)}" if kinds else None


class GraphedStep:
    """The decode step of one group: called as the model is in `static_decode.greedy_decode` (input_ids
    [rows, 1], the group's full-length attention_mask, position_ids [rows, 1], the cache and flags), returns an
    object with `.logits`. The first call runs eager and records; later calls replay."""

    def __init__(self, model):
        self.model = model
        self.failed: str | None = None  # the recording's error, once it failed
        self._replay = None
        self._mask = self._kwargs = self._ids = self._positions = self._logits = self._graph = None

    def __call__(self, *, input_ids, attention_mask, position_ids, **kwargs):
        if self.failed is not None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        if self._replay is None:
            return self._first(input_ids, attention_mask, position_ids, kwargs)
        if attention_mask is not self._mask or input_ids.shape != self._ids.shape:
            raise ValueError("a recorded decode step is called with another group's mask or shape: make a new "
                             "GraphedStep for each group")
        self._ids.copy_(input_ids)
        self._positions.copy_(position_ids)
        self._replay()
        return SimpleNamespace(logits=self._logits)

    def _call_buffers(self):
        return self.model(input_ids=self._ids, attention_mask=self._mask, position_ids=self._positions,
                          **self._kwargs).logits

    def _first(self, input_ids, attention_mask, position_ids, kwargs):
        import torch

        self._mask, self._kwargs = attention_mask, kwargs
        self._ids, self._positions = input_ids.clone(), position_ids.clone()
        if input_ids.device.type != "cuda":
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
            self._replay = self._run_eager
            return out
        side = torch.cuda.Stream(device=input_ids.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        out.logits.record_stream(torch.cuda.current_stream())  # made on the side stream, read on this one
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._logits = self._call_buffers()
        except torch.OutOfMemoryError:
            raise  # the generator splits the group and retries, as for any step
        except Exception as exc:  # noqa: BLE001 - whatever refused the recording, the eager step still works
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            self._logits = None
            warnings.warn(f"regenerate: recording the decode step as a CUDA graph failed ({self.failed}); this "
                          "group's steps run eager and the later groups' compiled (the same tokens)", RuntimeWarning,
                          stacklevel=2)
            return out
        self._graph, self._replay = graph, graph.replay
        return out

    def _run_eager(self) -> None:
        self._logits = self._call_buffers()
