"""The compiled head epilogue (`objective.head: compiled`, the CUDA default) gives the eager head's loss,
argmax and gradients, through Inductor on this CPU, and compiles a bounded number of graphs: one per
loss kind and grad mode, whatever the chunk lengths."""

import pytest
import torch
from torch._dynamo.utils import counters

from dflash_train import compiled
from dflash_train.train import head_epilogue
from dflash_train.train.device import resolve_head
from dflash_train.train.loss import head_loss, reference_head_loss

slow = pytest.mark.slow  # Inductor's C++ compiles: ~30 s on 2 cores


def _case(m, h, v, seed, dtype=torch.float32, k=6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (m,), generator=g)
    w = torch.rand(m, generator=g)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(m)])
    p = torch.softmax(torch.randn(m, k, generator=g), -1)
    p[0, 3:] = 0  # entries with p = 0 are ignored (a reduced vocabulary's fallback rows)
    return hidden, weight, labels, w, (ids, p)


def _run(hidden, weight, labels, w, kind, target, chunk, compiled, grad_weight=True):
    h = hidden.clone().requires_grad_()
    wt = weight.clone().requires_grad_(grad_weight)
    loss, preds = head_loss(h, wt, labels, w, kind, target if kind == "kl" else None, chunk=chunk, compiled=compiled)
    (loss * 0.5).backward()
    return loss.detach(), preds, h.grad, wt.grad


@slow
@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_compiled_head_equals_eager_and_the_reference_at_every_chunk_length(kind):
    torch._dynamo.reset()  # a count of its own, whatever compiled the epilogue earlier in the worker
    base = counters["stats"]["unique_graphs"]
    for m, chunk in ((23, 7), (40, 9), (13, 13)):  # last chunks of 2, 4 and 13 rows
        case = _case(m, 16, 97, seed=m)
        eager = _run(*case[:4], kind, case[4], chunk, compiled=False)
        fused = _run(*case[:4], kind, case[4], chunk, compiled=True)
        h, wt = case[0].clone().requires_grad_(), case[1].clone().requires_grad_()
        ref, ref_preds = reference_head_loss(h, wt, case[2], case[3], kind, case[4])
        (ref * 0.5).backward()
        assert torch.allclose(fused[0], ref, rtol=1e-5, atol=1e-5), (m, fused[0], ref)
        assert torch.allclose(fused[0], eager[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(fused[1], ref_preds) and torch.equal(fused[1], eager[1])
        assert torch.allclose(fused[2], h.grad, atol=1e-5) and torch.allclose(fused[2], eager[2], atol=1e-6)
        assert torch.allclose(fused[3], wt.grad, atol=1e-5) and torch.allclose(fused[3], eager[3], atol=1e-6)
    with torch.no_grad():  # the held-out check: no gradient, its own graph
        case = _case(31, 16, 97, seed=5)
        fused = head_loss(*case[:4], kind, case[4] if kind == "kl" else None, chunk=8, compiled=True)
        eager = head_loss(*case[:4], kind, case[4] if kind == "kl" else None, chunk=8, compiled=False)
    assert torch.allclose(fused[0], eager[0], rtol=1e-6) and torch.equal(fused[1], eager[1])
    # chunk lengths 7, 2, 9, 4, 13 share one graph with the gradient (the rows are dynamic from the first
    # call) and 8 and 7 one without
    assert counters["stats"]["unique_graphs"] - base == 2


@slow
def test_compiled_head_in_bf16_matches_the_eager_bf16_head():
    """The GPU's dtype: bf16 hidden states and head, fp32 logits, the softmax written in bf16."""
    case = _case(37, 32, 211, seed=3, dtype=torch.bfloat16)
    eager = _run(*case[:4], "ce", None, 16, compiled=False, grad_weight=False)
    fused = _run(*case[:4], "ce", None, 16, compiled=True, grad_weight=False)
    assert torch.allclose(fused[0], eager[0], rtol=1e-5)
    assert torch.equal(fused[1], eager[1])
    assert fused[2].dtype == torch.bfloat16 and fused[3] is None
    assert torch.allclose(fused[2].float(), eager[2].float(), atol=2e-2, rtol=2e-2)


def test_head_choice_resolves_by_device_and_names_the_field():
    assert resolve_head("auto", "cuda") == "compiled"
    assert resolve_head("auto", "cpu") == "eager"
    assert resolve_head("compiled", "cpu") == "compiled"
    with pytest.raises(ValueError, match="objective.head 'fast'"):
        resolve_head("fast", "cpu")


def test_a_compile_failure_warns_once_and_runs_eager_while_other_errors_propagate(monkeypatch):
    """A Triton / Inductor failure on the machine at hand must not end a run: the epilogue falls back to
    the eager maths (the same numbers); an error that is not the compiler's is raised as it is."""
    calls = []

    def broken(name, fn):
        def run(*args):
            calls.append(name)
            raise torch._dynamo.exc.TorchDynamoException("triton: no kernel for this GPU")
        return run

    monkeypatch.setattr(compiled, "compiled", broken)
    monkeypatch.setattr(compiled, "fallbacks", {})
    case = _case(9, 8, 31, seed=1)
    with pytest.warns(UserWarning, match=r"objective.head compiled: head ce epilogue did not compile here .*triton"):
        fused = head_loss(*case[:4], chunk=4, compiled=True)
    eager = head_loss(*case[:4], chunk=4, compiled=False)
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])
    assert calls == ["head ce epilogue"]  # tried once; the next chunks and calls go straight to eager
    assert list(compiled.fallbacks) == ["head ce epilogue"]

    def wrong(name, fn):
        def run(*args):
            raise ValueError("a bug in the maths")
        return run

    monkeypatch.setattr(compiled, "compiled", wrong)
    with pytest.raises(ValueError, match="a bug in the maths"):
        head_loss(*case[:4], "kl", case[4], chunk=4, compiled=True)
    with pytest.raises(torch.OutOfMemoryError):  # out of memory is the caller's to report, never hidden
        monkeypatch.setattr(compiled, "compiled", lambda name, fn: _raise(torch.OutOfMemoryError("CUDA oom")))
        head_loss(*case[:4], "kl", case[4], chunk=4, compiled=True)


def _raise(exc):
    def run(*args):
        raise exc
    return run


@pytest.mark.parametrize("head, expected", [("compiled", ["head ce epilogue"]), ("eager", [])])
def test_the_training_step_runs_the_head_it_is_asked_for(monkeypatch, head, expected):
    """microbatch_loss(head=...) reaches the compiled epilogue exactly when asked (the step's own head
    weight once shadowed the choice, so a GPU run silently kept the eager head)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    from bench_train_step import Shape, build_step

    from dflash_train.train.batches import microbatch_loss

    seen = []

    def spy(name, fn, args, dynamic=None, knob=""):
        seen.append(name)
        return fn(*args)

    monkeypatch.setattr(head_epilogue, "call", spy)
    model, mb = build_step(Shape(hidden=32, intermediate=64, heads=2, kv_heads=1, head_dim=16, vocab=256,
                                 target_hidden=32, features=2, tokens=96, anchors=8, block=4), "cpu", torch.float32)
    microbatch_loss(model, mb, chunk=64, head=head)
    assert sorted(set(seen)) == expected


@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_the_exp_floor_leaves_widely_spread_logits_exact(kind):
    """A trained head's log-probabilities reach far below the exp floor (-87, where torch's CPU exp turns slow):
    the epilogue's loss, argmax and dL/dlogits there equal float64 maths without the floor."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 512, generator=g) * 40  # log-probabilities down to about -300
    labels = torch.randint(0, 512, (64,), generator=g)
    ids = torch.stack([torch.randperm(512, generator=g)[:6] for _ in range(64)])
    p = torch.softmax(torch.randn(64, 6, generator=g), -1)
    logp64 = torch.log_softmax(logits.double(), -1)
    assert (logp64 < head_epilogue.EXP_FLOOR).float().mean() > 0.5
    if kind == "ce":
        loss, preds, d = head_epilogue.ce_chunk(logits.clone(), labels, torch.float32)
        ref_loss, ref_d = -logp64.gather(1, labels[:, None]).squeeze(1), logp64.exp()
    else:
        loss, preds, d = head_epilogue.kl_chunk(logits.clone(), ids, p, torch.float32)
        p64 = p.double()
        ref_loss = (torch.xlogy(p64, p64) - p64 * logp64.gather(1, ids)).sum(-1)
        ref_d = logp64.exp().scatter_add(1, ids, -p64)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(d.double(), ref_d, rtol=1e-5, atol=1e-6)
    assert torch.equal(preds, logits.argmax(-1))
