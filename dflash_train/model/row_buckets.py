"""CPU half-precision matmuls with their row counts rounded up to a few sizes.

On a CPU, torch runs bf16 and fp16 matmuls through oneDNN, which compiles a kernel for every new
shape (its primitive cache keys on the exact sizes). A training step's row counts change with every
micro-batch (the packed tokens, the blocks placed, the labelled slots), so each step compiled a dozen
kernels anew: on 2 cores of an Intel Xeon with AMX the demo's fc matmul (~1,000 x 2,880 x 576) took
3.9 ms to run and 10-14 ms to compile, and compiling was 40% of the step. fp32 matmuls go to MKL,
which compiles nothing: they are left as they are.

`rows(n)` rounds a count up to one of 8 sizes per octave (multiples of 16 below 256, then of
1/8 of the power of two below it): at most 1/8 more rows (15 below 128), and a run meets a few dozen shapes
instead of one per step. The padding is zeros, so every product that is kept is the unpadded matmul's
sum (a padded row of A adds a row that is sliced off; a padded inner dimension adds zero products),
rounded as oneDNN's blocking for the padded shape adds it up (bf16 outputs may differ by an ulp);
autograd sees a pad and a slice, so the gradients' matmuls are bucketed too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HALF = (torch.bfloat16, torch.float16)
ENABLED = True  # False: every matmul at its own shape (bench/bench_train_step.py --row-buckets compares)


def rows(n: int) -> int:
    """`n` rounded up to a multiple of max(16, 2**(bit_length(n) - 4)): 8 sizes an octave."""
    step = max(16, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def compiles_per_shape(x: torch.Tensor) -> bool:
    """True where a matmul on `x` runs in half precision on a CPU (its own dtype or the CPU's autocast)."""
    if not ENABLED or x.device.type != "cpu" or torch.compiler.is_compiling():
        return False  # a compiled graph's matmuls keep their shapes: the padding would pin them (a guard per size)
    return x.dtype in HALF or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in HALF)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with x's rows (every leading dimension, flattened) padded to `rows()`."""
    n = x.shape[:-1].numel()
    pad = rows(n) - n if n and compiles_per_shape(x) else 0
    if not pad:
        return F.linear(x, weight, bias)
    out = F.linear(F.pad(x.reshape(n, x.shape[-1]), (0, 0, 0, pad)), weight, bias)
    return out[:n].view(*x.shape[:-1], out.shape[-1])


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D operands with a's rows and the inner dimension padded to `rows()` (zeros)."""
    if not compiles_per_shape(a):
        return a @ b
    m, k = a.shape
    pm, pk = rows(m) - m, rows(k) - k
    if pm or pk:  # a transposed view (a gradient's d.t()) is padded as its transpose: no transposing copy
        a = F.pad(a.t(), (0, pm, 0, pk)).t() if a.stride(0) == 1 and a.stride(1) != 1 else F.pad(a, (0, pk, 0, pm))
    if pk:
        b = F.pad(b.t(), (0, pk)).t() if b.stride(0) == 1 and b.stride(1) != 1 else F.pad(b, (0, 0, 0, pk))
    out = a @ b
    return out[:m] if pm else out


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state-dict names) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
