"""Muon for the drafter's hidden matrices (train/optimizer.DeviceMuon, `optim.algorithm: muon`): the
orthogonalisation, the update rule against torch.optim.Muon's, AdamW for everything else, the clip, resuming,
which weights take Muon, and the settings Muon cannot run under."""

import copy

import pytest
import torch

from dflash_train.errors import ConfigError
from dflash_train.train.optimizer import DeviceAdamW, DeviceMuon, build_optimizer, muon_dtype, orthogonalize


def _matrix(rows, cols, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (32, 32)])
def test_orthogonalize_flattens_the_spectrum_and_keeps_the_singular_vectors(shape):
    """A matrix with singular values over two decades comes out with all of them near 1 and its singular vectors
    (U V^T's direction), tall, wide or square."""
    k = min(shape)
    u, _ = torch.linalg.qr(_matrix(shape[0], k, seed=1))
    v, _ = torch.linalg.qr(_matrix(shape[1], k, seed=2))
    g = u @ torch.diag(torch.logspace(0, 2, k)) @ v.t()
    out = orthogonalize(g, 5, torch.float32)
    assert out.shape == g.shape and out.dtype == torch.float32
    s = torch.linalg.svdvals(out)
    # Muon's coefficients trade exactness for speed: every singular value lands in about [0.7, 1.2]
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25, s
    cos = torch.nn.functional.cosine_similarity(out.flatten(), (u @ v.t()).flatten(), dim=0)
    assert float(cos) > 0.97
    # the negative control: one iteration leaves the small singular values small
    assert float(torch.linalg.svdvals(orthogonalize(g, 1, torch.float32)).min()) < 0.6


def _layered(seed=0):
    """Three matrices for Muon (two of one shape up to a transpose, as gate and down), a head-like matrix and a
    gain for AdamW."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(16, 40, generator=g) * 0.1),
            torch.nn.Parameter(torch.randn(40, 16, generator=g) * 0.1),
            torch.nn.Parameter(torch.randn(16, 24, generator=g) * 0.1),
            torch.nn.Parameter(torch.randn(50, 16, generator=g) * 0.1),
            torch.nn.Parameter(torch.ones(16))]


def _set_grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def _muon_pair(nesterov=True, steps=4):
    """Our DeviceMuon (iteration in fp32) and torch.optim.Muon (its iteration in bf16) over the same gradients;
    AdamW's share against a DeviceAdamW over the same tensors."""
    ours, ref, ref_adam = _layered(), _layered(), _layered()
    kw = dict(lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
    opt = DeviceMuon(ours, ours[:3], grad_clip=0.0, fp32_masters=False, **kw)
    opt.ns_dtype = torch.float32
    ref_muon = torch.optim.Muon(ref[:3], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, ns_steps=5,
                                adjust_lr_fn="match_rms_adamw")
    ref_other = DeviceAdamW(ref_adam[3:], grad_clip=0.0, fp32_masters=False, **kw)
    for step in range(steps):
        for ps in (ours, ref, ref_adam):
            _set_grads(ps, step)
        for o in (opt, ref_muon, ref_other):
            o.step()
            o.zero_grad()
    return ours, ref, ref_adam


def _saved_then_resumed(kw: dict, before: int, after) -> tuple[list, list, dict]:
    """A DeviceMuon stepped `before` times, its state saved and loaded into another over copies of its weights,
    then both stepped over the gradients of `after`: asserts their masters stay bit-identical and returns
    (the first's weights, the resumed one's, the saved state)."""
    ps = _layered()
    opt = DeviceMuon(ps, ps[:3], **kw)
    for step in range(before):
        _set_grads(ps, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    again = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resumed = DeviceMuon(again, again[:3], **kw)
    resumed.load_state_dict(saved)
    for step in after:
        for group, o in ((ps, opt), (again, resumed)):
            _set_grads(group, step)
            o.step()
    for a, b in zip(opt.masters, resumed.masters, strict=True):
        assert torch.equal(a, b)
    return ps, again, saved


@torch.no_grad()
def test_the_matrices_step_as_torch_muon_and_the_rest_as_adamw():
    ours, ref, ref_adam = _muon_pair()
    for a, b, start in zip(ours[:3], ref[:3], _layered()[:3], strict=True):
        moved, diff = float((b - start).norm()), float((a - b).norm())
        assert moved > 0.05 and diff < 0.03 * moved  # ~1%: torch's bf16 iteration against our fp32 one
    for a, b in zip(ours[3:], ref_adam[3:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the negative controls: another rule (momentum without Nesterov's blend) is ~20% away; the head moves
    # otherwise when it takes Muon
    _, plain, _ = _muon_pair(nesterov=False)
    assert float((ours[0] - plain[0]).norm()) > 0.1 * float((plain[0] - _layered()[0]).norm())
    other = _layered()
    opt2 = DeviceMuon(other, other[:4], lr=0.02, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=0.0,
                      fp32_masters=False)
    for step in range(4):
        _set_grads(other, step)
        opt2.step()
    assert float((other[3] - ours[3]).norm()) > 0.01


def test_the_clip_reaches_muons_momentum():
    """The first step's update is the orthogonalised gradient whatever its scale, but the momentum buffer
    holds the clipped gradient: (1 - momentum) * clip_factor * g."""
    for fused in (True, False):
        ps = _layered()
        opt = DeviceMuon(ps, ps[:3], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=0.5,
                         fp32_masters=False)
        if not fused:
            opt.defaults["fused"] = None
            for group in opt.param_groups:
                group["fused"], group["foreach"] = None, True
        _set_grads(ps, 0, scale=3.0)
        grads = [p.grad.clone() for p in ps]
        factor = 0.5 / float(torch.nn.utils.get_total_norm(grads))
        assert factor < 0.2
        opt.step()
        torch.testing.assert_close(opt.muon_momentum[0], 0.05 * factor * grads[0], rtol=1e-5, atol=1e-8)


def test_muon_on_bf16_weights_resumes_exactly_with_its_momentum():
    ps = _layered()
    opt = DeviceMuon(ps, ps[:3], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0, fp32_masters=True)
    for p in ps:
        p.data = p.data.bfloat16()
    for step in range(3):
        _set_grads(ps, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert all(b is not None for b in saved["muon_momentum"])
    again = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = DeviceMuon(again, again[:3], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0,
                      fp32_masters=True)
    opt2.load_state_dict(saved)
    for group, o in ((ps, opt), (again, opt2)):
        _set_grads(group, 9)
        o.step()
    for a, b in zip(opt.masters, opt2.masters, strict=True):
        assert torch.equal(a, b)
    # without its momentum the next step differs: what resuming must carry
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in again]
    opt3 = DeviceMuon(fresh, fresh[:3], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0,
                      fp32_masters=True)
    assert opt3.muon_momentum[0] is None
    with pytest.raises(ValueError, match="Muon's momentum"):
        opt3.load_state_dict(DeviceAdamW(fresh, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0,
                                         fp32_masters=True).state_dict())


def test_the_iteration_runs_in_bf16_where_the_hardware_has_it_and_auto_picks_it(monkeypatch):
    import dflash_train.machine as machine

    monkeypatch.delenv("DFLASH_AUTO_DTYPE", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(machine, "cpu_bf16_instructions", lambda: ["avx512_bf16"])
    assert muon_dtype(torch.device("cpu")) == torch.bfloat16
    # oneDNN capped below the bf16 instructions emulates them, as `auto` knows: the iteration goes to fp32
    # (round 25: the bf16 iteration under an AVX2 cap made the demo's step 1.58 s against 0.21 s)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert muon_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert muon_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv("DFLASH_AUTO_DTYPE", "float32")  # the pin holds for the iteration too
    assert muon_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.delenv("DFLASH_AUTO_DTYPE")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(machine, "cpu_bf16_instructions", lambda: [])
    assert muon_dtype(torch.device("cpu")) == torch.float32
    assert muon_dtype(torch.device("cuda")) == torch.bfloat16


def test_muon_takes_the_layers_and_fc_and_leaves_the_head_and_norms_to_adamw():
    from dflash_train.model.config import DFlashConfig
    from dflash_train.model.modeling_dflash import DFlashDraftModel
    from dflash_train.train.engine import muon_matrices

    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=100, draft_vocab_size=50, target_hidden_size=32,
                       num_target_layers=4, aux_hidden_state_layer_ids=[1, 3], block_size=4, mask_token_id=3,
                       dtype="float32")
    model = DFlashDraftModel(cfg)
    chosen = {id(p) for p in muon_matrices(model)}
    names = {n for n, p in model.named_parameters() if id(p) in chosen}
    assert "fc.weight" in names and "layers.1.mlp.down_proj.weight" in names
    assert "layers.0.self_attn.q_proj.weight" in names
    assert not any("lm_head" in n or "norm" in n for n in names)
    assert len(names) == 1 + 2 * 7  # fc, and q/k/v/o, gate/up/down in each layer


@pytest.mark.parametrize("on, expected", [
    (["attention"], {f"layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qkvo"}),
    (["mlp"], {f"layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up", "down")}),
    (["fc"], {"fc.weight"}),
    (["fc", "attention"], {"fc.weight"} | {f"layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qkvo"}),
])
def test_optim_muon_on_gives_muon_only_the_groups_it_names(on, expected):
    from dflash_train.model.config import DFlashConfig
    from dflash_train.model.modeling_dflash import DFlashDraftModel
    from dflash_train.train.engine import muon_matrices

    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=100, draft_vocab_size=50, target_hidden_size=32,
                       num_target_layers=4, aux_hidden_state_layer_ids=[1, 3], block_size=4, mask_token_id=3,
                       dtype="float32")
    model = DFlashDraftModel(cfg)
    chosen = {id(p) for p in muon_matrices(model, on)}
    assert {n for n, p in model.named_parameters() if id(p) in chosen} == expected
    with pytest.raises(ValueError, match=r"optim.muon_on: unknown group\(s\) \['head'\]"):
        muon_matrices(model, ["head"])


def test_a_recipe_names_muons_groups_by_name():
    from dflash_train.errors import ConfigError
    from dflash_train.train.recipe import load_recipe

    recipe = load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.algorithm=muon", "optim.muon_on=[attention,fc]"])
    assert recipe.recipe.optim.muon_on == ["attention", "fc"]
    assert load_recipe("recipes/smollm2-135m-demo.yaml", []).recipe.optim.muon_on == ["attention"]  # round 23
    assert load_recipe(None, [], base={"data": {"prepared": "rows"}}).recipe.optim.muon_on == ["attention", "mlp", "fc"]
    with pytest.raises(ConfigError, match=r"optim.muon_on.0: Input should be 'attention', 'mlp' or 'fc'"):
        load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.muon_on=[head]"])
    with pytest.raises(ConfigError, match=r"optim.muon_on: List should have at least 1 item"):
        load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.muon_on=[]"])


def test_muon_refuses_settings_it_cannot_run_under():
    ps = _layered()
    with pytest.raises(ValueError, match="engine.zero_stage: 0"):
        build_optimizer(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0, own_step=False,
                        fp32_masters=False, muon=ps[:3])
    with pytest.raises(ValueError, match="no trainable matrix"):
        DeviceMuon(ps, ps[4:], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0, fp32_masters=False)
    from dflash_train.train.recipe import load_recipe

    with pytest.raises(ConfigError, match="algorithm"):
        load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.algorithm=lion"])
    # a recipe that could not run it is refused when it loads, not after the target and data are ready
    for sets in (["engine.zero_stage=1"], ["engine.optimizer=deepspeed"]):
        with pytest.raises(ConfigError, match="engine.zero_stage: 0 and engine.optimizer: torch"):
            load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.algorithm=muon", *sets])


@torch.no_grad()
def test_muon_every_k_steps_reuses_the_last_direction_and_keeps_every_gradient():
    """optim.muon_every 3: steps 0 and 3 orthogonalise; steps 1 and 2 move each matrix exactly as step 0 did (no
    weight decay, one lr); the momentum takes every gradient, as with a refresh every step."""
    kw = dict(lr=0.02, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=0.0, fp32_masters=False)
    lazy, eager = _layered(), _layered()
    opt = DeviceMuon(lazy, lazy[:3], every=3, **kw)
    ref = DeviceMuon(eager, eager[:3], **kw)
    for o in (opt, ref):
        o.ns_dtype = torch.float32
    moves = []
    for step in range(4):
        before = [p.detach().clone() for p in lazy[:3]]
        for ps, o in ((lazy, opt), (eager, ref)):
            _set_grads(ps, step)
            o.step()
        moves.append([p - b for p, b in zip(lazy[:3], before, strict=True)])
        for a, b in zip(opt.muon_momentum, ref.muon_momentum, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    for k in range(3):
        torch.testing.assert_close(moves[1][k], moves[0][k], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(moves[2][k], moves[0][k], rtol=1e-5, atol=1e-8)
        # the refresh at step 3 orthogonalises the momentum of four gradients: another direction
        assert float((moves[3][k] - moves[0][k]).norm()) > 0.1 * float(moves[0][k].norm())
    # a refresh every step is the same rule as before: step 1 of the eager run moved otherwise than step 0
    assert float((lazy[0] - eager[0]).norm()) > 1e-3


def test_muon_every_resumes_mid_cycle_exactly():
    """A state saved between refreshes carries the direction being reused and the step count; without them a
    resume is refused (it would orthogonalise at another step and move otherwise)."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0, fp32_masters=True, every=4)
    ps, again, saved = _saved_then_resumed(kw, before=2, after=range(2, 6))  # through the refresh at step 4
    assert saved["muon_steps"] == 2 and all(d is not None for d in saved["muon_direction"])
    every_step = DeviceMuon(ps, ps[:3], **{**kw, "every": 1}).state_dict()
    with pytest.raises(ValueError, match="optim.muon_every"):
        DeviceMuon(again, again[:3], **kw).load_state_dict(every_step)
    with pytest.raises(ValueError, match="optim.muon_every is 0"):
        DeviceMuon(again, again[:3], **{**kw, "every": 0})
    from dflash_train.train.recipe import load_recipe

    with pytest.raises(ConfigError, match="muon_every"):
        load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.algorithm=muon", "optim.muon_every=0"])
    assert load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.muon_every=8"]).recipe.optim.muon_every == 8


def test_a_stack_is_orthogonalised_matrix_by_matrix():
    """DeviceMuon runs matrices of one shape (up to a transpose) as one stack: each must come out as it would
    alone (its own norm, no mixing between the stack's members)."""
    stack = torch.stack([_matrix(24, 64, seed=s) * (10.0 ** s) for s in range(3)])
    together = orthogonalize(stack, 5, torch.float32)
    for k in range(3):
        torch.testing.assert_close(together[k], orthogonalize(stack[k], 5, torch.float32), rtol=1e-4, atol=1e-5)
    tall = orthogonalize(stack.mT, 5, torch.float32)
    torch.testing.assert_close(tall, together.mT, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_muon_steps_on_a_gpu_as_on_the_cpu():
    """The CUDA path (bf16 weights on fp32 masters, the iteration in bf16 on the GPU) follows the CPU's fp32
    iteration within bf16's rounding over a few steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    runs = {}
    for device in ("cpu", "cuda"):
        ps = [torch.nn.Parameter(p.detach().to(device)) for p in _layered()]
        opt = DeviceMuon(ps, ps[:3], lr=0.02, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0,
                         fp32_masters=device == "cuda")
        if device == "cpu":
            opt.ns_dtype = torch.float32
        else:
            assert opt.ns_dtype == torch.bfloat16
            for p in ps:
                p.data = p.data.bfloat16()
        for step in range(4):
            _set_grads(ps, step)
            opt.step()
            opt.zero_grad()
        runs[device] = [m.detach().float().cpu() for m in opt.masters]
    start = _layered()
    for a, b, s in zip(runs["cpu"][:3], runs["cuda"][:3], start[:3], strict=True):
        assert float((a - b).norm()) < 0.05 * float((a - s.detach()).norm())


@torch.no_grad()
def test_muon_lr_scale_multiplies_the_muon_step_alone():
    """optim.muon_lr_scale 2.5: each Muon matrix moves 2.5x as far as at 1 over the same gradients (no weight
    decay: the step is then linear in the scale), AdamW's weights exactly as at 1; 0 or less is refused."""
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=0.0, fp32_masters=False)
    moved = {}
    for scale in (1.0, 2.5):
        ps = _layered()
        opt = DeviceMuon(ps, ps[:3], lr_scale=scale, **kw)
        opt.ns_dtype = torch.float32
        _set_grads(ps, 0)
        opt.step()
        moved[scale] = [p - start for p, start in zip(ps, _layered(), strict=True)]
    for a, b in zip(moved[1.0][:3], moved[2.5][:3], strict=True):
        assert float(a.norm()) > 1e-3
        torch.testing.assert_close(b, 2.5 * a, rtol=1e-4, atol=1e-7)
    for a, b in zip(moved[1.0][3:], moved[2.5][3:], strict=True):
        assert torch.equal(a, b)
    ps = _layered()
    with pytest.raises(ValueError, match="optim.muon_lr_scale is 0"):
        DeviceMuon(ps, ps[:3], lr_scale=0.0, **kw)
    from dflash_train.train.recipe import load_recipe

    with pytest.raises(ConfigError, match="muon_lr_scale"):
        load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.muon_lr_scale=-1"])
    assert load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.muon_lr_scale=1.5"]).recipe.optim.muon_lr_scale == 1.5


def _neuron_rms(update: torch.Tensor) -> torch.Tensor:
    """One RMS per neuron: per row of a square or tall matrix, per column of a wide one."""
    return update.square().mean(dim=-1 if update.shape[0] >= update.shape[1] else 0).sqrt()


@torch.no_grad()
def test_normuon_evens_the_neurons_keeps_the_update_norm_and_follows_its_running_mean():
    """optim.muon_variant normuon: the first step moves every neuron of a Muon matrix by the same RMS, with the
    plain Muon step's norm (Muon alone leaves the neurons uneven: the negative control); over four steps the
    matrices follow a reference written from the rule (a running mean of squares, beta2 0.95, no bias correction,
    the orthogonalised update's norm restored), AdamW's weights are untouched by the variant."""
    kw = dict(lr=0.02, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=0.0, fp32_masters=False)
    start = _layered()
    moves = {}
    for variant in ("muon", "normuon"):
        ps = _layered()
        opt = DeviceMuon(ps, ps[:3], variant=variant, **kw)
        opt.ns_dtype = torch.float32
        _set_grads(ps, 0)
        opt.step()
        moves[variant] = [p - s for p, s in zip(ps, start, strict=True)]
    for plain, norm in zip(moves["muon"][:3], moves["normuon"][:3], strict=True):
        torch.testing.assert_close(norm.norm(), plain.norm(), rtol=1e-5, atol=0)
        even, uneven = _neuron_rms(norm), _neuron_rms(plain)
        assert float(even.max() / even.min()) < 1 + 1e-4
        assert float(uneven.max() / uneven.min()) > 1.05
    for plain, norm in zip(moves["muon"][3:], moves["normuon"][3:], strict=True):
        assert torch.equal(plain, norm)

    ps, ref = _layered(), _layered()
    opt = DeviceMuon(ps, ps[:3], variant="normuon", **kw)
    opt.ns_dtype = torch.float32
    momentum = [torch.zeros_like(p) for p in ref[:3]]
    second = [None] * 3
    for step in range(4):
        _set_grads(ps, step)
        opt.step()
        _set_grads(ref, step)
        for k, p in enumerate(ref[:3]):
            momentum[k] = 0.95 * momentum[k] + 0.05 * p.grad
            o = orthogonalize(0.95 * momentum[k] + 0.05 * p.grad, 5, torch.float32)
            square = _neuron_rms(o).square()
            square = square[:, None] if o.shape[0] >= o.shape[1] else square[None, :]
            second[k] = 0.05 * square if second[k] is None else 0.95 * second[k] + 0.05 * square
            n = o / second[k].sqrt()
            p -= 0.02 * 0.2 * max(p.shape) ** 0.5 * n * (o.norm() / n.norm())
    for a, b in zip(ps[:3], ref[:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_normuon_resumes_exactly_with_its_mean_squares_and_is_named_by_the_recipe():
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, grad_clip=1.0, fp32_masters=True, variant="normuon")
    ps, again, saved = _saved_then_resumed(kw, before=3, after=[7])
    assert all(v is not None for v in saved["muon_second"])
    plain = DeviceMuon(ps, ps[:3], **{**kw, "variant": "muon"}).state_dict()
    with pytest.raises(ValueError, match="NorMuon's per-neuron mean squares"):
        DeviceMuon(again, again[:3], **kw).load_state_dict(plain)
    with pytest.raises(ValueError, match="optim.muon_variant is 'adam'"):
        DeviceMuon(again, again[:3], **{**kw, "variant": "adam"})
    from dflash_train.train.recipe import load_recipe

    with pytest.raises(ConfigError, match="muon_variant"):
        load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.muon_variant=adam"])
    recipe = load_recipe("recipes/smollm2-135m-demo.yaml", ["optim.muon_variant=normuon"]).recipe
    assert recipe.optim.muon_variant == "normuon"
