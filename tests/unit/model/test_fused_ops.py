"""The draft layers' fused ops (`objective.layer_kernels: compiled`, the CUDA default), compiled by Inductor on
this CPU: the eager layers' values and gradients, and a bounded number of graphs for a whole step."""

import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_train import compiled
from dflash_train.model import fused_ops
from dflash_train.model.modeling_dflash import DFlashRMSNorm, apply_rope

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
slow = pytest.mark.slow  # Inductor's C++ compiles


def _grads(fn, *inputs):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(g)
    return out.detach(), [x.grad for x in leaves if x.requires_grad]


def _eager_norm(x, w, eps=1e-6):
    """The modeling file's RMSNorm with `w` as its weight (a leaf of the caller's graph)."""
    return torch.func.functional_call(DFlashRMSNorm(x.shape[-1], eps), {"weight": w}, (x,))


def _eager_swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


@slow
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_each_fused_op_gives_the_eager_values_and_gradients(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 32, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype)
    cases = {
        "rms_norm": (lambda a, b: fused_ops.rms_norm(a, b, 1e-6), _eager_norm, (x, w)),
        "swiglu": (fused_ops.swiglu, _eager_swiglu, (x, torch.randn(5, 7, 32, generator=g).to(dtype))),
        # queries [N, heads, B, d] that come out of a transpose (not contiguous), cos/sin [N, B, d]
        "rope": (fused_ops.apply_rope, apply_rope,
                 (torch.randn(5, 7, 4, 16, generator=g).to(dtype).transpose(1, 2),
                  torch.randn(5, 7, 16, generator=g).to(dtype), torch.randn(5, 7, 16, generator=g).to(dtype))),
        # the context's keys [heads, T, d] against [T, d]
        "rope-context": (fused_ops.apply_rope, apply_rope,
                         (torch.randn(2, 11, 16, generator=g).to(dtype), torch.randn(11, 16, generator=g).to(dtype),
                          torch.randn(11, 16, generator=g).to(dtype))),
    }
    for name, (fused, eager, inputs) in cases.items():
        if name.startswith("rope"):  # cos/sin carry no gradient
            out_f, grads_f = _grads(lambda a, c=inputs[1], s=inputs[2], f=fused: f(a, c, s), inputs[0])
            out_e, grads_e = _grads(lambda a, c=inputs[1], s=inputs[2], f=eager: f(a, c, s), inputs[0])
        else:
            out_f, grads_f = _grads(fused, *inputs)
            out_e, grads_e = _grads(eager, *inputs)
        assert out_f.dtype == out_e.dtype and out_f.shape == out_e.shape, name
        torch.testing.assert_close(out_f.float(), out_e.float(), atol=tol, rtol=tol, msg=name)
        assert len(grads_f) == len(grads_e), name
        for gf, ge in zip(grads_f, grads_e, strict=True):
            assert gf.dtype == ge.dtype, name
            scale = ge.float().abs().max()
            assert float((gf.float() - ge.float()).abs().max()) <= tol * max(1.0, float(scale)), name
    assert compiled.fallbacks == {}


@slow
def test_a_whole_step_with_fused_ops_equals_eager_and_compiles_ten_graphs():
    """Two micro-batch shapes, with and without activation checkpointing, and the no-grad check: the loss
    and every gradient of the eager layers, from RMSNorm at two sizes, SwiGLU and RoPE on blocks and
    context, each forward and backward: 10 graphs in all."""
    from bench_train_step import Shape, build_step

    from dflash_train.train.batches import microbatch_loss

    shape = Shape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=1024, target_hidden=64,
                  features=5, tokens=384, anchors=48, block=16, layers=2)
    model, mb = build_step(shape, "cpu", torch.float32)
    _, mb2 = build_step(Shape(**{**shape.__dict__, "tokens": 300, "anchors": 30}), "cpu", torch.float32)

    def step(batch):
        model.zero_grad()
        loss, _ = microbatch_loss(model, batch, chunk=256)
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = [step(mb), step(mb2)]
    torch._dynamo.reset()  # a count of its own, whatever compiled these functions earlier in the worker
    base = counters["stats"]["unique_graphs"]
    model.use_fused_ops(True)
    fused = [step(mb), step(mb2)]
    model.activation_checkpointing = True
    fused.append(step(mb))
    with torch.no_grad():
        microbatch_loss(model, mb2, chunk=256)
    for (loss_e, grads_e), (loss_f, grads_f) in zip(eager + eager[:1], fused, strict=True):
        assert abs(loss_f - loss_e) <= 1e-5 * abs(loss_e)
        assert grads_f.keys() == grads_e.keys()
        for name, ge in grads_e.items():
            assert float((grads_f[name] - ge).abs().max()) <= 1e-5 * max(1.0, float(ge.abs().max())), name
    assert counters["stats"]["unique_graphs"] - base == 10
    assert compiled.fallbacks == {}
    model.use_fused_ops(False)
    assert step(mb)[0] == eager[0][0]  # off again: the eager layers exactly


def test_a_failed_compile_runs_that_op_eager_with_one_warning(monkeypatch):
    def broken(name, fn):
        def run(*args):
            raise torch._dynamo.exc.TorchDynamoException("no triton for this GPU")
        return run

    monkeypatch.setattr(compiled, "compiled", broken)
    monkeypatch.setattr(compiled, "fallbacks", {})
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    with pytest.warns(UserWarning, match=r"objective.layer_kernels compiled: rms_norm forward did not compile"):
        out = fused_ops.rms_norm(x, w, 1e-6)
    with pytest.warns(UserWarning, match="rms_norm backward did not compile"):
        out.sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    ref = _eager_norm(ref_x, torch.ones(8))
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, ref_x.grad)
    assert set(compiled.fallbacks) == {"rms_norm forward", "rms_norm backward"}
