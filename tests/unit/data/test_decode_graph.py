"""data/decode_graph.py, the regeneration's decode step recorded as a CUDA graph. What a CPU can check: a decode
step of the real SmolLM2 never makes the host wait for the device (what a recording refuses); the first step
eager, then replays over the buffers, give plain greedy generate's tokens, one recording per group; which caches
may be recorded; a recording that fails leaves the later groups to the compiled step. The recording itself runs
on a GPU only (`pytest -m gpu`)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_train.data import decode_graph as dg
from dflash_train.data import hf_generate as hg
from dflash_train.data import static_decode
from dflash_train.target import cache_kwarg

NEW = 40
STOP = [2]
pytestmark = pytest.mark.usefixtures("one_thread_module")  # small-batch decoding, fixtures too


class HostWork(TorchDispatchMode):
    """Stops at the first operator a recording would refuse or replay wrong: one whose result the host must wait
    for (a tensor read into a Python number, a data-dependent shape), or one that takes a tensor from the host (a
    replay would reuse what it held when recorded). Counts the operators called."""

    WAITS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default)

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func in self.WAITS:
            raise AssertionError(f"{func} makes the host wait for the device")
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" for t in tensors):
            raise AssertionError(f"{func} takes a tensor from the host")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def reference(smollm2, stopping_prompts):
    model, tok = smollm2
    out = []
    for p in stopping_prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=2)[0, len(p):]
        ids = ids.tolist()
        ids = ids[: ids.index(2)] if 2 in ids else ids
        out.append((tok.decode(ids, skip_special_tokens=True).strip(), len(ids), len(ids) >= NEW))
    assert len({n for _, n, _ in out}) > 1  # rows stop at different steps
    return out


def test_a_decode_step_never_makes_the_host_wait(smollm2_path, smollm2):
    """The regeneration's decode step (static cache, the GQA decode attention, a left-padded group's full mask),
    run on the meta device: no operator reads the device from the host or takes a tensor from it, so recorded on
    a GPU it replays as it ran."""
    from transformers import StaticCache

    meta = torch.device("meta")
    with pytest.raises(AssertionError, match="_local_scalar_dense.default makes the host wait"), HostWork():
        bool(torch.ones(3, device=meta).all())  # the audit stops where there is a host read...
    with pytest.raises(AssertionError, match="add.Tensor takes a tensor from the host"), HostWork():
        torch.ones(3, device=meta) + torch.ones(3)  # ...or a host tensor
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, static_cache=True)
    model = gen.model.to(meta)
    text = model.config
    rows, width = 3, 24
    cache = StaticCache(config=text, max_cache_len=width + NEW)
    cache.early_initialization(rows, text.num_key_value_heads, text.hidden_size // text.num_attention_heads,
                               torch.float32, meta)
    assert dg.recordable(cache) is None
    mask = torch.ones((rows, width + NEW), dtype=torch.long, device=meta)
    with torch.no_grad(), HostWork() as audit:
        out = model(input_ids=torch.zeros((rows, 1), dtype=torch.long, device=meta), attention_mask=mask,
                    position_ids=torch.zeros((rows, 1), dtype=torch.long, device=meta), use_cache=True,
                    logits_to_keep=1, **{cache_kwarg(model): cache})
    assert out.logits.shape == (rows, 1, text.vocab_size)
    assert audit.ops > 30 * 20  # every layer's operators went through the audit
    # a prefill's shape (two tokens into an empty cache) does work on the host, in transformers' mask: the audit
    # follows the model's own code
    with torch.no_grad(), pytest.raises(AssertionError, match="takes a tensor from the host|makes the host wait"), \
            HostWork():
        model(input_ids=torch.zeros((rows, 2), dtype=torch.long, device=meta), attention_mask=mask,
              position_ids=torch.zeros((rows, 2), dtype=torch.long, device=meta), use_cache=True, logits_to_keep=1,
              **{cache_kwarg(model): StaticCache(config=text, max_cache_len=width + NEW)})


def test_graphs_give_plain_greedy_tokens_with_one_recording_per_group(smollm2_path, smollm2, stopping_prompts, reference,
                                                                     monkeypatch):
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, static_cache=True, decode_step="graphs")
    gen.max_rows = 2  # two groups
    made, replays, steps = [], [], []
    real_init, real_buffers, real_decode = dg.GraphedStep.__init__, dg.GraphedStep._call_buffers, \
        static_decode.greedy_decode
    monkeypatch.setattr(dg.GraphedStep, "__init__", lambda self, model: made.append(self) or real_init(self, model))
    monkeypatch.setattr(dg.GraphedStep, "_call_buffers", lambda self: replays.append(self) or real_buffers(self))

    def decode(model, step, *a, **kw):
        assert kw == {"shrink": False}  # a recorded step keeps its group's rows
        tokens = real_decode(model, step, *a, **kw)
        steps.append((step, tokens.shape[1] - 1))  # decode steps after the prefill's token
        return tokens

    monkeypatch.setattr(static_decode, "greedy_decode", decode)
    assert gen.generate(stopping_prompts) == reference
    assert len(made) == len(steps) == 2 and [s for s, _ in steps] == made  # a new recording for each group
    assert all(s.failed is None and s._replay is not None for s in made)
    for step, n in steps:  # the first step eager on the caller's tensors, every later one over the buffers
        assert replays.count(step) == n - 1 > 10
    assert gen.decode_step == "graphs"


def test_a_recorded_step_refuses_another_groups_mask(smollm2_path, smollm2, stopping_prompts):
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, 3, 0.0, static_cache=True, decode_step="graphs")
    cache = gen._static_cache(1, 64)
    step = dg.GraphedStep(gen.model)
    ids, mask = torch.full((1, 64), 2), torch.zeros((1, 64), dtype=torch.long)
    ids[0, -len(stopping_prompts[0]):], mask[0, -len(stopping_prompts[0]):] = torch.tensor(stopping_prompts[0]), 1
    kw = {"use_cache": True, "logits_to_keep": 1, cache_kwarg(gen.model): cache}
    with torch.no_grad():
        gen.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **kw)
        full = torch.ones((1, 67), dtype=torch.long)
        full[:, :64] = mask
        position = mask.sum(-1)[:, None]
        step(input_ids=torch.tensor([[5]]), attention_mask=full, position_ids=position, **kw)
        with pytest.raises(ValueError, match="another group's mask or shape"):
            step(input_ids=torch.tensor([[6]]), attention_mask=full.clone(), position_ids=position + 1, **kw)


def test_only_caches_of_plain_static_layers_are_recorded(smollm2_path, smollm2, stopping_prompts, monkeypatch):
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import StaticSlidingWindowLayer

    config = smollm2[0].config
    cache = StaticCache(config=config, max_cache_len=64)
    assert dg.recordable(cache) is None
    cache.layers[3] = StaticSlidingWindowLayer(max_cache_len=64, sliding_window=16)
    assert dg.recordable(cache) == "cache layers of kind StaticSlidingWindowLayer"
    assert "DynamicLayer" in dg.recordable(DynamicCache(config=config))
    with pytest.raises(ValueError, match="decode_step must be one of auto, graphs, compiled, eager, got 'cuda'"):
        hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, 3, 0.0, decode_step="cuda")
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, 3, 0.0, static_cache=True, decode_step="graphs")
    monkeypatch.setattr(hg, "recordable", lambda c: "cache layers of kind Hybrid")
    with pytest.raises(ValueError, match=r"cannot be recorded \(cache layers of kind Hybrid\); use 'compiled'"):
        gen.generate(stopping_prompts[:1])
    auto = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, 3, 0.0, static_cache=True)
    monkeypatch.undo()
    auto.generate(stopping_prompts[:1])
    assert auto.decode_step == "compiled" and auto._step == auto.model.__call__  # a CPU: the eager call


def test_a_failed_recording_warns_and_later_groups_take_the_compiled_step(smollm2_path, smollm2, stopping_prompts, reference,
                                                                         monkeypatch):
    """What the generator does when a GPU refuses a recording (simulated: a CPU cannot record): the group
    finishes eager, one warning, and the groups after it take the compiled step, as before graphs."""
    made = []

    class Refused(dg.GraphedStep):
        def _first(self, input_ids, attention_mask, position_ids, kwargs):
            made.append(self)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
            self.failed = "RuntimeError: operation not permitted when stream is capturing"
            warnings.warn(f"recording failed ({self.failed})", RuntimeWarning, stacklevel=2)
            return out

    monkeypatch.setattr(hg, "GraphedStep", Refused)
    gen = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, static_cache=True, decode_step="graphs")
    gen.max_rows = 2
    with pytest.warns(RuntimeWarning, match="operation not permitted") as caught:
        assert gen.generate(stopping_prompts) == reference
    assert len(made) == 1 and len(caught) == 1 and gen.decode_step == "compiled"
    assert gen._step == gen.model.__call__  # the compiled step's call (eager on a CPU)


@pytest.mark.gpu
def test_recorded_steps_on_a_gpu_decode_as_the_eager_step(smollm2_path, smollm2, stopping_prompts):
    """On CUDA `auto` records: every group's step holds a graph, no recording failed, and the rows are the eager
    step's (the replay runs its kernels; a row may differ only where bf16 rounding splits a greedy tie)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    many = stopping_prompts * 8
    graphed = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0)
    graphed.max_rows = 16  # two groups
    made = []
    real_init = dg.GraphedStep.__init__
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed recording warns: fail here instead
        mp.setattr(dg.GraphedStep, "__init__", lambda self, model: made.append(self) or real_init(self, model))
        got = graphed.generate(many)
    assert graphed.decode_step == "graphs" and len(made) == 2
    assert all(s._graph is not None and s.failed is None for s in made)
    eager = hg.HFGenerator(str(smollm2_path), smollm2[1], STOP, NEW, 0.0, decode_step="eager")
    eager.max_rows = 16
    want = eager.generate(many)
    assert sum(a == b for a, b in zip(got, want, strict=True)) >= 0.9 * len(many)
