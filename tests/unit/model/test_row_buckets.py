"""model/row_buckets.py: CPU half-precision matmuls see a few row counts, and give what unpadded ones give."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_train.model import row_buckets
from dflash_train.model.row_buckets import mm, rows

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))


def test_rows_rounds_up_by_at_most_an_eighth_to_eight_sizes_an_octave():
    for n in range(1, 5000):
        r = rows(n)
        assert r >= n and r % 16 == 0
        assert r - n < max(16, n / 8), n
    for lo in (256, 512, 1024, 2048):
        assert len({rows(n) for n in range(lo + 1, 2 * lo + 1)}) == 8
    assert rows(1024) == 1024 and rows(1025) == 1152


def test_padded_products_equal_the_unpadded_ones():
    torch.manual_seed(0)
    for m, k, n in [(813, 576, 4096), (1000, 2880, 576), (37, 64, 96)]:
        a32, b32 = torch.randn(m, k), torch.randn(k, n)
        for a, b in [(a32.bfloat16(), b32.bfloat16()), (a32.t().contiguous().bfloat16().t(), b32.bfloat16()),
                     (a32.bfloat16(), b32.t().contiguous().bfloat16().t())]:  # transposed views as the head has
            out, ref = mm(a, b), a @ b
            assert out.shape == ref.shape == (m, n)
            # the same sums; oneDNN's blocking for the padded shape may round a bf16 output by an ulp
            torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2 * ref.abs().max().item())
        assert torch.equal(mm(a32, b32), a32 @ b32)  # fp32 goes to MKL as it is


def test_linear_pads_the_forward_and_its_gradients_agree():
    torch.manual_seed(0)
    x = torch.randn(7, 29, 96, requires_grad=True)
    lin = row_buckets.Linear(96, 80)
    ref_lin = torch.nn.Linear(96, 80)
    ref_lin.load_state_dict(lin.state_dict())  # the same parameters under the same names
    xr = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = lin(x), ref_lin(xr)
    assert out.shape == ref.shape == (7, 29, 80) and out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    (out.float() * torch.arange(80)).sum().backward()
    (ref.float() * torch.arange(80)).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(lin.weight.grad, ref_lin.weight.grad, rtol=2e-2, atol=5e-1)
    torch.testing.assert_close(lin.bias.grad, ref_lin.bias.grad)
    assert torch.equal(lin(x), ref_lin(x))  # fp32: untouched


class _MatmulRows(TorchDispatchMode):
    """The row counts (and inner dimensions) of every matmul dispatched on the CPU in half precision."""

    def __init__(self):
        super().__init__()
        self.dims = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm") and args[-2].dtype == torch.bfloat16:
            a, b = args[-2], args[-1]
            self.dims.append((a.shape[0], a.shape[1], b.shape[1]))
        return func(*args, **(kwargs or {}))


def test_a_training_step_of_any_size_meets_bucketed_matmuls_only():
    """The demo's step (bf16-mixed, prefix weighting) on micro-batches of other sizes: every bf16 matmul of the
    forward, the backward and the head has its varying dimensions at a bucket, so oneDNN compiles a few kernels
    for a run instead of a dozen a step; off (`ENABLED = False`), the raw counts reach it."""
    from bench_train_step import DEMO_B4, build_step

    from dflash_train.train.batches import microbatch_loss

    fixed = {576, 1536, 2880, 4096, 192}  # hidden, MLP, features, draft vocab, kv width: the model's own sizes

    def step_dims(tokens, anchors):
        model, mb = build_step(replace(DEMO_B4, tokens=tokens, anchors=anchors))
        with _MatmulRows() as seen:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = microbatch_loss(model, mb, chunk=1024, prefix_weighting=True)
            loss.backward()
        return seen.dims, float(loss.detach())

    for tokens, anchors in [(1000, 150), (871, 133)]:
        dims, loss = step_dims(tokens, anchors)
        varying = {d for dim in dims for d in dim if d not in fixed}
        assert dims and varying, dims
        assert all(d == rows(d) for d in varying), sorted(varying)
    row_buckets.ENABLED = False
    try:
        raw, raw_loss = step_dims(871, 133)
    finally:
        row_buckets.ENABLED = True
    assert any(d != rows(d) for dim in raw for d in dim if d not in fixed)
    assert loss == pytest.approx(raw_loss, rel=1e-2)


def test_the_bucketed_attention_grid_computes_the_same_step(monkeypatch):
    """Split attention's grid of runs rounded up (runs to a multiple of 4, blocks a run and span to `rows`):
    the added runs, rows and context columns are padding no block reads or attends to. In fp32, with the grid
    forced on, the loss and every gradient equal the unpadded grid's to fp32 rounding."""
    from bench_train_step import DEMO_DOCS, build_step

    import dflash_train.model.modeling_dflash as modeling
    from dflash_train.train.batches import microbatch_loss

    model, mb = build_step(replace(DEMO_DOCS, tokens=7 * 111, documents=7, anchors=7 * 21))
    natural = mb.layout.grid_size()
    grid = mb.layout.padded_runs(None, bucket=True)
    assert (grid.runs, grid.per_run, grid.span) != natural[:3]  # the sizes were not buckets already
    assert grid.runs % 4 == 0 and grid.per_run == rows(natural[1]) and grid.span == rows(natural[2])

    def step(bucket):
        monkeypatch.setattr(modeling.row_buckets, "compiles_per_shape", lambda x: bucket)
        model.zero_grad()
        loss, _ = microbatch_loss(model, mb, chunk=256)
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    del mb.layout.cache[("padded", None, True)]
    (loss_a, grads_a), (loss_b, grads_b) = step(False), step(True)
    assert {("padded", None, False), ("padded", None, True)} <= mb.layout.cache.keys()  # both took the grid
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=1e-5, atol=1e-6 * max(1.0, float(g.abs().max())), msg=name)
