"""The optimizer step without host waits (train/optimizer.py): DeviceAdamW equals torch's AdamW with
torch's clip, keeps fp32 masters under bf16 weights, resumes exactly, never reads a device value (meta
device), and a real DeepSpeed step with it makes no host read at all, where DeepSpeed's own bf16 wrapper
makes one per parameter (the negative control)."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.train.optimizer import DeviceAdamW, build_optimizer

HERE = Path(__file__).resolve().parent


def _params(seed=0, device="cpu", n=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(8, 3 + i, generator=g).to(device)) for i in range(n)]


def _grads(params, seed, scale=3.0):
    g = torch.Generator().manual_seed(100 + seed)
    return [torch.randn(p.shape, generator=g) * scale for p in params]


@pytest.mark.parametrize("clip", [0.0, 0.5, 1e6])
def test_device_adamw_equals_torch_adamw_after_torch_clip(clip):
    ours, ref = _params(), _params()
    opt = DeviceAdamW(ours, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=clip, fp32_masters=False)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(3):
        for ps in (ours, ref):
            for p, g in zip(ps, _grads(ps, step), strict=True):
                p.grad = g.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref, clip)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in ours)


def test_the_fused_step_clips_inside_adamws_kernel_without_a_pass_of_its_own(monkeypatch):
    """The fused kernel applies the clip as its grad_scale: no multi-tensor multiply over the gradients, and
    the same weights as torch's clip; the foreach path (no fused kernel) multiplies."""
    calls = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    results = {}
    for fused in (True, False):
        ps = _params()
        opt = DeviceAdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=0.5, fp32_masters=False)
        opt.defaults["fused"] = fused or None
        for group in opt.param_groups:
            group["fused"], group["foreach"] = fused or None, not fused
        calls.clear()
        for p, g in zip(ps, _grads(ps, 0), strict=True):
            p.grad = g
        opt.step()
        results[fused] = (ps, len(calls))
    assert results[True][1] == 0 and results[False][1] >= 1
    for a, b in zip(results[True][0], results[False][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bf16_weights_step_on_fp32_masters_and_resume_exactly():
    """bf16 weights (engine.precision bf16 without ZeRO): the update is computed on fp32 masters taken
    before the cast, so steps smaller than bf16's resolution still accumulate; the weights are the
    masters rounded. state_dict carries the masters: a reloaded optimizer continues bit for bit."""
    fp32 = _params()
    bf16 = _params()
    opt = DeviceAdamW(bf16, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0, fp32_masters=True)
    ref = torch.optim.AdamW(fp32, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    for p in bf16:
        p.data = p.data.bfloat16()
    start = [p.detach().clone() for p in bf16]
    for step in range(4):
        grads = _grads(fp32, step)
        for p, q, g in zip(fp32, bf16, grads, strict=True):
            p.grad, q.grad = g.bfloat16().float(), g.bfloat16()
        torch.nn.utils.clip_grad_norm_(fp32, 1.0)
        ref.step()
        opt.step()
        ref.zero_grad()
        opt.zero_grad()
    for m, p, r in zip(opt.masters, bf16, fp32, strict=True):
        assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)  # the fp32 trajectory, not a bf16 one
        assert torch.equal(p, m.bfloat16())
    # 4 steps of ~1e-4 move a weight of size ~1 by less than bf16's spacing: only the masters moved
    assert sum(int((p != s).sum()) for p, s in zip(bf16, start, strict=True)) < sum(p.numel() for p in bf16) // 2
    saved = copy.deepcopy(opt.state_dict())  # as a checkpoint file holds it (state_dict returns live tensors)
    again = [torch.nn.Parameter(p.detach().clone()) for p in bf16]
    opt2 = DeviceAdamW(again, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0, fp32_masters=True)
    opt2.load_state_dict(saved)
    for ps, o in ((bf16, opt), (again, opt2)):
        for p, g in zip(ps, _grads(ps, 9), strict=True):
            p.grad = g.bfloat16()
        o.step()
    for a, b in zip(opt.masters, opt2.masters, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="fp32 master"):
        opt2.load_state_dict(torch.optim.AdamW(again).state_dict())


def test_fused_where_torch_has_the_kernel_and_foreach_on_meta():
    assert DeviceAdamW(_params(), lr=1, betas=(0.9, 0.9), weight_decay=0, grad_clip=1, fp32_masters=False
                       ).defaults["fused"]
    meta = DeviceAdamW(_params(device="meta"), lr=1, betas=(0.9, 0.9), weight_decay=0, grad_clip=1,
                       fp32_masters=True)
    assert not meta.defaults["fused"] and meta.defaults["foreach"]
    assert isinstance(build_optimizer(_params(), lr=1, betas=(0.9, 0.9), weight_decay=0, grad_clip=1,
                                      own_step=False, fp32_masters=False), torch.optim.AdamW)


def test_the_step_never_reads_the_device():
    """On the meta device every read of a value raises: masters, norm, clip factor and update stay there."""
    params = _params(device="meta")
    opt = DeviceAdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0, fp32_masters=True)
    for p in params:
        p.data = p.data.bfloat16()
        p.grad = torch.empty(p.shape, dtype=torch.bfloat16, device="meta")
    opt.step()
    assert opt._global_grad_norm.device.type == "meta" and opt.masters[0].device.type == "meta"
    with pytest.raises((RuntimeError, NotImplementedError)):
        float(opt._global_grad_norm)  # the negative control: a host read on meta raises


READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


def host_reads_in_a_deepspeed_step(ours: bool) -> dict:
    """A real DeepSpeed engine (ZeRO-0, bf16 weights, grad clip 1, 2 accumulation steps) on CPU: the number
    of tensor-to-host reads (`item`, `bool`, `float`, ...) in `engine.backward` and `engine.step` over one
    optimizer step. ours=False builds DeepSpeed's own path (its bf16 mode and clipping: it wraps the
    optimizer in FP16_UnfusedOptimizer), the configuration before this module."""
    import deepspeed

    from dflash_train.train.engine import build_engine, deepspeed_config, init_distributed
    from dflash_train.train.recipe import load_recipe

    init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    recipe = load_recipe(None, base={"data": {"prepared": "rows"}, "optim": {"grad_clip": 1.0},
                                     "batch": {"grad_accum": 2}, "engine": {"precision": "bf16"}}).recipe
    if ours:
        engine, _ = build_engine(model, recipe, 10)
    else:
        cfg = {**deepspeed_config(recipe), "gradient_clipping": 1.0, "bf16": {"enabled": True}}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                          config=cfg, dist_init_required=False)
    counts = dict.fromkeys(READS, 0)
    real = {name: getattr(torch.Tensor, name) for name in READS}
    reduces = []  # DeepSpeed's gradient all-reduce: a flatten, a collective and a copy back of every gradient
    real_reduce = engine.allreduce_gradients

    def counted_reduce(*args, **kwargs):
        reduces.append(1)
        return real_reduce(*args, **kwargs)

    engine.allreduce_gradients = counted_reduce

    def counting(name):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return real[name](self, *args, **kwargs)
        return read

    x = torch.randn(2, 8, 16)
    for step in range(2):  # the first step builds optimizer state; count the second
        losses = [engine.module(x[i].to(torch.bfloat16)).float().pow(2).sum() for i in range(2)]
        try:
            if step:
                for name in READS:
                    setattr(torch.Tensor, name, counting(name))
            for loss in losses:
                engine.backward(loss)
                engine.step()
        finally:
            for name in READS:
                setattr(torch.Tensor, name, real[name])
    return {"reads": counts, "optimizer": type(engine.optimizer).__name__, "params": len(list(model.parameters())),
            "weight_dtype": str(next(model.parameters()).dtype), "allreduces": len(reduces)}


@pytest.mark.slow
def test_a_deepspeed_bf16_step_reads_nothing_back_where_deepspeeds_wrapper_reads_per_parameter():
    """Also: one process without ZeRO skips DeepSpeed's gradient all-reduce, which it runs on a world of one
    (the negative control counts it)."""
    results = {}
    for ours in (True, False):
        code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); from test_optimizer import "
                f"host_reads_in_a_deepspeed_step as f; print(json.dumps(f({ours})))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert out.returncode == 0, out.stderr[-3000:]
        results[ours] = json.loads(out.stdout.strip().splitlines()[-1])
    mine, theirs = results[True], results[False]
    assert mine["optimizer"] == "DeviceAdamW" and mine["weight_dtype"] == "torch.bfloat16"
    assert sum(mine["reads"].values()) == 0, mine["reads"]
    assert theirs["optimizer"] == "FP16_UnfusedOptimizer" and theirs["weight_dtype"] == "torch.bfloat16"
    assert sum(theirs["reads"].values()) >= theirs["params"], theirs["reads"]  # a host wait per parameter
    assert mine["allreduces"] == 0 and theirs["allreduces"] >= 2, (mine, theirs)  # one per optimizer step


@pytest.mark.gpu
def test_the_fused_cuda_step_makes_no_host_sync_and_equals_the_cpu_step():
    """On a GPU: torch's sync debug mode turns any synchronising call inside the step into an error; the
    fused CUDA update lands within fp32 rounding of the CPU one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cpu, gpu = _params(), _params(device="cuda")
    opts = [DeviceAdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=0.5, fp32_masters=True)
            for ps in (cpu, gpu)]
    assert opts[1].defaults["fused"]
    for ps in (cpu, gpu):
        for p in ps:
            p.data = p.data.bfloat16()
    for step in range(3):
        for ps, opt in zip((cpu, gpu), opts, strict=True):
            for p, g in zip(ps, _grads(ps, step), strict=True):
                p.grad = g.bfloat16().to(p.device)
            if ps is gpu:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.step()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(opts[0].masters, opts[1].masters, strict=True):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-6)


def test_the_process_group_is_torn_down_before_the_interpreter_exits():
    """A gloo group left to the interpreter's finalization can abort a finished process ("terminate called
    without an active exception", exit -6, seen once in CI). A handler registered before `init_distributed`
    runs after its teardown (atexit is last-in first-out) and sees no group."""
    code = ("import atexit, torch.distributed as dist\n"
            "atexit.register(lambda: print('group alive at exit:', dist.is_initialized(), flush=True))\n"
            "from dflash_train.train.engine import init_distributed\n"
            "w = init_distributed(); print('world', w.size, dist.is_initialized(), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["world", "1", "True", "group", "alive", "at", "exit:", "False"], out.stdout


def _matrix_and_gain():
    """A weight matrix and a norm's gain, both at 1, with zero gradients: AdamW's step is then the decay
    alone, p <- p * (1 - lr * weight_decay)."""
    params = [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


@pytest.mark.parametrize("build", ["device", "device-masters", "zero"])
@pytest.mark.parametrize("decay_on", ["matrices", "all"])
def test_weight_decay_on_matrices_leaves_the_norms_gains_alone(build, decay_on):
    params = _matrix_and_gain()
    kw = dict(lr=0.5, betas=(0.9, 0.95), weight_decay=0.2, grad_clip=1.0, decay_on=decay_on)
    if build == "zero":  # torch's AdamW, for DeepSpeed's ZeRO optimizers to wrap
        opt = build_optimizer(params, own_step=False, fp32_masters=False, **kw)
    else:
        opt = build_optimizer(params, own_step=True, fp32_masters=build == "device-masters", **kw)
    opt.step()
    matrix, gain = params
    torch.testing.assert_close(matrix, torch.full((4, 3), 0.9), rtol=0, atol=1e-6)
    torch.testing.assert_close(gain, torch.full((3,), 0.9 if decay_on == "all" else 1.0), rtol=0, atol=1e-6)


def test_weight_decay_on_names_the_field_when_unknown():
    with pytest.raises(ValueError, match="optim.weight_decay_on is 'norms'"):
        build_optimizer(_matrix_and_gain(), lr=1, betas=(0.9, 0.9), weight_decay=0.1, grad_clip=1,
                        own_step=True, fp32_masters=False, decay_on="norms")
    from dflash_train.errors import ConfigError
    from dflash_train.train.recipe import load_recipe
    with pytest.raises(ConfigError, match="optim.weight_decay_on"):
        load_recipe(None, base={"data": {"prepared": "rows"}, "optim": {"weight_decay_on": "norms"}})


@pytest.mark.parametrize("optimizer", ["torch", pytest.param("deepspeed", marks=pytest.mark.slow)])  # builds an op
def test_the_engine_decays_the_drafters_matrices_and_not_its_norms(optimizer):
    """A real DeepSpeed engine over a real drafter: its optimizer decays every weight of two or more dimensions
    (the layers' projections, the trained head) and none of the norms' gains; the recipe's `all` decays both."""
    from dflash_train.model.config import DFlashConfig
    from dflash_train.model.modeling_dflash import DFlashDraftModel
    from dflash_train.train.engine import build_engine, init_distributed
    from dflash_train.train.recipe import load_recipe

    init_distributed()
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=300, draft_vocab_size=300, target_hidden_size=64,
                       num_target_layers=8, aux_hidden_state_layer_ids=[2, 5], block_size=4, mask_token_id=299,
                       dtype="float32")
    for decay_on in ("matrices", "all"):
        model = DFlashDraftModel(cfg)
        model.init_weights(seed=0)
        recipe = load_recipe(None, base={"data": {"prepared": "rows"}, "engine": {"precision": "fp32",
                                                                                  "optimizer": optimizer},
                                         "optim": {"weight_decay": 0.1, "weight_decay_on": decay_on}}).recipe
        engine, _ = build_engine(model, recipe, 10)
        decay = {id(p): g["weight_decay"] for g in engine.optimizer.param_groups for p in g["params"]}
        names = {n: decay[id(p)] for n, p in model.named_parameters() if p.requires_grad}
        norms = [n for n in names if "norm" in n]
        matrices = [n for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
        assert norms and matrices and set(norms).isdisjoint(matrices)
        assert all(names[n] == 0.1 for n in matrices)
        assert all(names[n] == (0.1 if decay_on == "all" else 0.0) for n in norms), names


def test_the_logged_gradient_norm_is_the_clips_own_over_the_window():
    from dflash_train.train.metrics import GradNormWindow

    params = _params(n=3)
    opt = DeviceAdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0, fp32_masters=False)
    window = GradNormWindow(opt, 1.0, torch.device("cpu"))
    norms = []
    for seed, scale in ((0, 3.0), (1, 0.001), (2, 0.05)):
        grads = _grads(params, seed, scale)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
        opt.step()
        window.add()
    assert norms[0] > 1.0 > norms[2] > norms[1]  # one step clipped, two not
    got = window.read()
    assert got["grad_norm"] == pytest.approx(sum(norms) / 3, rel=1e-5)
    assert got["grad_norm_max"] == pytest.approx(norms[0], rel=1e-5)
    assert got["clipped"] == pytest.approx(1 / 3)
    assert window.read() == {}  # a new window: nothing since
    # no clip, no norm computed: nothing is logged rather than a made-up number
    plain = DeviceAdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=0.0, fp32_masters=False)
    none = GradNormWindow(plain, 0.0, torch.device("cpu"))
    for p, g in zip(params, _grads(params, 3), strict=True):
        p.grad = g
    plain.step()
    none.add()
    assert none.read() == {}
