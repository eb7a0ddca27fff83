"""Optional compiled kernels: `torch.compile` a pure function once, call it, and fall back to the eager
function where the compiler fails on the machine at hand.

The fused kernels of the GPU path (the LM head's epilogue, the draft layers' RMSNorm / SwiGLU / RoPE)
are speed-ups of maths that also runs eager. A compile that fails (a Triton or C++ build problem, an
unsupported op in an older torch: an error of Dynamo or Inductor, never an out-of-memory or a bug in
the maths) must not end a run: that function warns once, runs eager from then on (the same results,
slower) and is listed in `fallbacks`, which summary.json and the bench rows report.

Every function is compiled with `fullgraph=True` (a graph break would silently run the slow path) and
the dimensions the caller names dynamic (`maybe_mark_dynamic`), so one graph serves every length.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

fallbacks: dict[str, str] = {}  # name -> why it runs eager although compiled was asked for
_COMPILED: dict[str, Callable] = {}


def compile_failure(exc: BaseException) -> bool:
    """An error of torch's compiler stack (Dynamo, Inductor, the Triton or C++ build under them)."""
    return (isinstance(exc, torch._dynamo.exc.TorchDynamoException)
            or type(exc).__module__.startswith(("torch._inductor", "triton")))


def compiled(name: str, fn: Callable) -> Callable:
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, fullgraph=True, dynamic=None)
    return _COMPILED[name]


def call(name: str, fn: Callable, args: Sequence, dynamic: dict[int, Sequence[int]] | None = None,
         knob: str = "a compiled kernel", detach: bool = True):
    """fn(*args), compiled under `name`. `dynamic`: {argument index: its dimensions that vary from call to
    call}. `knob`: the recipe field that turns it off, named in the fallback warning. detach: the tensors go in
    as plain tensors (False: autograd runs through the graph, as the training forward's does)."""
    if name in fallbacks:
        return fn(*args)
    # plain tensors: a compiled graph guards on requires_grad and on Parameter-or-not, which a function
    # called from inside an autograd.Function has no use for (it runs without autograd)
    args = [a.detach() if detach and isinstance(a, torch.Tensor) else a for a in args]
    for i, dims in (dynamic or {}).items():
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(args[i], d)
    try:
        return compiled(name, fn)(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        if not compile_failure(exc):
            raise
        why = (str(exc).strip().splitlines() or [""])[0][:300]
        fallbacks[name] = f"{type(exc).__name__}: {why}"
        warnings.warn(f"{knob}: {name} did not compile here ({fallbacks[name]}); it runs eager from now on "
                      "(same results, slower)", stacklevel=3)
        return fn(*args)
