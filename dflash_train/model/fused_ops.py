"""The draft layers' memory-bound pieces as fused kernels (`objective.layer_kernels: compiled`, the CUDA
default): RMSNorm, SwiGLU's silu(gate) * up, and RoPE.

Eager, each is several passes over its activations (RMSNorm: cast, square, mean, scale, cast, weight;
its backward as many again), which at Qwen3-8B drafter shapes is memory traffic, not arithmetic. Each
is an autograd.Function here whose forward and backward are pure functions compiled by Inductor (one
Triton kernel each on a GPU), in the manner of liger-kernel's RMSNorm / SwiGLU / RoPE but without its
dependency: the maths is exactly what modeling_dflash.py computes eager, with fp32 inside and one
rounding to the activations' dtype at the end. The backward recomputes silu and the normalised input
from what the forward saved (its input), so no intermediate is kept.

Graphs. A Function's forward runs without autograd and its backward is a plain function, so no graph
depends on the grad mode; rows are dynamic (`maybe_mark_dynamic`). A run compiles about ten: RMSNorm at
the hidden size and at the head size, SwiGLU, RoPE on the blocks and on the context, each forward and
backward. A compile that fails on the machine at hand runs that piece eager (dflash_train/compiled.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_train.compiled import call

KNOB = "objective.layer_kernels compiled"
ROPE_DYNAMIC = {0: [0, 1, 2], 1: [0, 1], 2: [0, 1]}  # x [A, heads, n, d]: A, the heads (q or kv) and n vary


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """R x = (-x2, x1) over the last dim: RoPE's rotation, eager (modeling_dflash) and fused (here)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


# RMSNorm: out = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), x [M, H] -------------------------
def _rms_forward(x, weight, eps: float):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf * rstd).to(x.dtype), rstd


def _rms_backward(grad, x, weight, rstd):
    xhat = x.float() * rstd
    grad_weight = (grad.float() * xhat.to(x.dtype).float()).sum(0)
    gy = grad.float() * weight.float()
    grad_x = rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.reshape(-1, x.shape[-1])
        out, rstd = call("rms_norm forward", _rms_forward, (rows, weight, eps), {0: [0]}, KNOB)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        rows, weight, rstd = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x, grad_weight = call("rms_norm backward", _rms_backward, (g, rows, weight, rstd),
                                   {0: [0], 1: [0], 3: [0]}, KNOB)
        return grad_x.view(ctx.shape), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, weight, eps)


# SwiGLU: silu(gate) * up, [M, I] -----------------------------------------------------------------
def _swiglu_forward(gate, up):
    return (F.silu(gate.float()) * up.float()).to(up.dtype)


def _swiglu_backward(grad, gate, up):
    g, u, d = gate.float(), up.float(), grad.float()
    s = torch.sigmoid(g)
    grad_up = d * g * s
    grad_gate = d * u * s * (1 + g * (1 - s))
    return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        ctx.save_for_backward(g, u)
        ctx.shape = gate.shape
        return call("swiglu forward", _swiglu_forward, (g, u), {0: [0], 1: [0]}, KNOB).view(gate.shape)

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        grad_gate, grad_up = call("swiglu backward", _swiglu_backward, (grad.reshape(g.shape), g, u),
                                  {0: [0], 1: [0], 2: [0]}, KNOB)
        return grad_gate.view(ctx.shape), grad_up.view(ctx.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _SwiGLU.apply(gate, up)


# RoPE: x * cos + rotate_half(x) * sin, x [A, heads, n, d], cos/sin [A, n, d] ---------------------
def _rope_forward(x, cos, sin):
    xf, c, s = x.float(), cos.float().unsqueeze(-3), sin.float().unsqueeze(-3)
    return (xf * c + rotate_half(xf) * s).to(x.dtype)


def _rope_backward(grad, cos, sin):
    # rotate_half is R x = (-x2, x1), whose transpose is -R: the gradient is g * cos - R(g * sin)
    g, c, s = grad.float(), cos.float().unsqueeze(-3), sin.float().unsqueeze(-3)
    return g * c - rotate_half(g * s)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return call("rope forward", _rope_forward, (x, cos, sin), ROPE_DYNAMIC, KNOB)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        # contiguous: split attention's grid scores the blocks' keys as they are (k_blk.mT, no expanded copy), so
        # their gradient arrives transposed, and a graph guards on strides (a second backward graph otherwise)
        grad_x = call("rope backward", _rope_backward, (grad.contiguous(), cos, sin), ROPE_DYNAMIC, KNOB)
        return grad_x.to(ctx.dtype), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, n, d]; cos/sin [..., n, d] (no gradient), as modeling_dflash.apply_rope."""
    # contiguous tables: split attention's last layer passes the blocks' tables without the anchor's slot
    # (a view whose row stride is the whole block's), and a compiled graph guards on that stride: the view
    # compiled a second forward and backward graph. The copy is 1/heads of x's size
    cos, sin = cos.contiguous(), sin.contiguous()
    if x.dim() == 3:  # the context: [heads, T, d] against [T, d]
        return _RoPE.apply(x[None], cos[None], sin[None])[0]
    return _RoPE.apply(x, cos, sin)
