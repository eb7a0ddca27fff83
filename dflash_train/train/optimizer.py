"""The optimizer step without host waits: AdamW over fp32 master weights, the gradient clip on the device.

DeepSpeed wraps a client optimizer for bf16 weights without ZeRO in its `FP16_UnfusedOptimizer`, which
reads `bool(tensor)` once per parameter (its overflow check) and `.item()` for the gradient norm: a
host wait per parameter per step, so the GPU idles while the host catches up. Without ZeRO the engine
therefore gets this optimizer with DeepSpeed's bf16 mode and its gradient clipping off
(`engine.deepspeed_config`), and the step is all device work:

1. the model's gradients (bf16 under `engine.precision: bf16`) are cast to fp32 master gradients,
2. the global gradient norm and the clip factor min(1, clip / (norm + 1e-6)) stay tensors on the
   device (`torch.nn.utils.get_total_norm`; no comparison on the host),
3. AdamW updates the fp32 masters: `fused=True` (one kernel for all tensors) on CUDA and CPU, which
   applies the clip as its `grad_scale` (the gradient divided by 1 / factor as the kernel reads it, the
   hook torch's GradScaler uses): no pass of its own; the multi-tensor `foreach` path elsewhere (the meta
   device of the no-host-read test) multiplies the gradients first,
4. the masters are copied back into the model's weights.

With fp32 weights (`fp32`, `bf16-mixed`) the masters are the weights themselves. The masters are part of
`state_dict()`, so a resumed run continues from the same fp32 values. ZeRO 1-3 keep DeepSpeed's own
partitioned optimizers (and their clipping); they get a fused AdamW as the inner optimizer on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FUSED_DEVICES = ("cuda", "cpu")  # torch's fused AdamW kernels (CUDA since 2.0, CPU since 2.4)
DECAY_ON = ("matrices", "all")


def decay_groups(params: list[torch.Tensor], weight_decay: float, decay_on: str = "matrices") -> list[dict]:
    """torch parameter groups for AdamW: `matrices` decays the tensors of two or more dimensions (linear and
    embedding weights) and not the norms' gains or biases; `all` decays every tensor. Empty groups are left out."""
    if decay_on not in DECAY_ON:
        raise ValueError(f"optim.weight_decay_on is {decay_on!r}; use one of {', '.join(DECAY_ON)}")
    if decay_on == "all" or weight_decay == 0:
        return [{"params": list(params), "weight_decay": weight_decay}]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def fused_for(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW can step these tensors (all floating point, on one fused device type)."""
    return bool(params) and all(p.dtype.is_floating_point and p.device.type in FUSED_DEVICES for p in params)


class DeviceAdamW(torch.optim.AdamW):
    """AdamW on fp32 masters of `params` with the gradient clip computed on the device.

    `fp32_masters`: keep fp32 copies of the weights (taken now, before the caller casts the model to
    bf16); otherwise the weights are stepped in place. `grad_clip` <= 0: no clipping. `decay_on`: which
    weights decay (`decay_groups`)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
                 weight_decay: float, grad_clip: float, fp32_masters: bool, decay_on: str = "matrices"):
        self.model_params = [p for p in params if p.requires_grad]
        self.separate = fp32_masters
        masters = ([torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params] if fp32_masters
                   else self.model_params)
        fused = fused_for(masters)
        super().__init__(decay_groups(masters, weight_decay, decay_on), lr=lr, betas=betas, weight_decay=weight_decay,
                         fused=fused or None, foreach=None if fused else True)
        self.masters = masters
        self.grad_clip = float(grad_clip)
        self._global_grad_norm = None  # DeepSpeed copies it to engine._global_grad_norm (a device tensor)

    @torch.no_grad()
    def step(self, closure=None):
        pairs = [(p, m) for p, m in zip(self.model_params, self.masters, strict=True) if p.grad is not None]
        if self.separate:
            for p, m in pairs:
                m.grad = p.grad.to(torch.float32)
        live = [m for _, m in pairs]
        coef = None  # the clip's factor on the gradients, a device tensor (None: no clip)
        if self.grad_clip > 0 and live:
            grads = [m.grad for m in live]
            norm = torch.nn.utils.get_total_norm(grads)  # foreach where the device has it
            self._global_grad_norm = norm
            coef = (self.grad_clip / (norm + 1e-6)).clamp(max=1.0)  # a tensor: no comparison on the host
            if self.defaults.get("fused"):  # the kernel divides each gradient by grad_scale as it reads it:
                # the clip costs no pass of its own over the fp32 gradients (~8 bytes a parameter)
                self.grad_scale = ((norm + 1e-6) / self.grad_clip).clamp(min=1.0).to(torch.float32)
            elif all(g.device.type in FUSED_DEVICES for g in grads):
                torch._foreach_mul_(grads, coef)
                coef = None  # applied
            else:
                for g in grads:
                    g.mul_(coef)
                coef = None
        self._step_matrices(coef)
        loss = super().step(closure)
        if self.separate and pairs:
            model, master = [p for p, _ in pairs], [m for _, m in pairs]
            if hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(model, master)  # casts to the model's dtype
            else:
                for p, m in pairs:
                    p.copy_(m)
            for m in master:
                m.grad = None  # the fp32 gradients live only inside the step
        return loss

    def _step_matrices(self, coef: torch.Tensor | None) -> None:
        """Before AdamW's step: another rule's own update of some masters, their gradients then cleared so that
        AdamW skips them (`DeviceMuon`). coef: the clip's factor where the gradients do not carry it yet."""

    @property
    def computes_grad_norm(self) -> bool:
        """Whether `step` computes the global gradient norm (for the clip): the loop reads it, not twice."""
        return self.grad_clip > 0

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last step's global gradient norm, a device tensor (None before a step or without a clip)."""
        return self._global_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None

    def state_dict(self) -> dict:
        sd = super().state_dict()
        if self.separate:
            sd["fp32_masters"] = [m.detach().clone() for m in self.masters]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("fp32_masters", None)
        if (self.separate and masters is None) or "param_groups" not in state_dict:
            raise ValueError("optimizer state without this optimizer's fp32 master weights (saved by another "
                             "precision, optimizer or version: DeepSpeed's bf16 wrapper before DeviceAdamW); "
                             "resume with the settings and version the run was started with")
        super().load_state_dict(state_dict)
        if self.separate:
            with torch.no_grad():
                for m, saved in zip(self.masters, masters, strict=True):
                    m.copy_(saved)


# Newton-Schulz coefficients of Muon's quintic iteration (Keller Jordan's, as torch.optim.Muon's defaults):
# they push every singular value of the normalised update toward ~1 in a few steps without converging exactly
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """U V^T of g = U S V^T, approximately (singular values into ~[0.7, 1.2]): `steps` Newton-Schulz iterations
    of the quintic X <- aX + (b A + c A^2) X with A = X X^T, run in `dtype` on the short side of g. g is one
    matrix [r, c] or a stack of them [n, r, c] (each orthogonalised on its own, in batched matmuls). fp32 out."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    # the spectral norm is at most the Frobenius norm: every singular value <= 1
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    mm_add = torch.addmm if x.dim() == 2 else torch.baddbmm  # beta * input + alpha * (m1 @ m2), one kernel
    for _ in range(steps):
        gram = x @ x.mT
        x = mm_add(x, mm_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).float()


def muon_dtype(device: torch.device) -> torch.dtype:
    """The Newton-Schulz iteration's dtype: bf16 where the hardware multiplies it natively (a GPU, a CPU with
    bf16 instructions: ~0.11 s a step for the demo drafter's eight matrices on 2 Zen 4 cores, by
    `bench/bench_train_step.py --optimizer`), fp32 elsewhere (an
    emulated bf16 iteration was ~8x the whole CPU step on Ice Lake: docs/results/2026-11-29-drafter-quality-round-14.md).
    The CPU's pick is `auto`'s (`machine.auto_dtype`): a `ONEDNN_MAX_CPU_ISA` cap below the bf16 instructions
    emulates bf16 too (the demo's step 1.58 s against 0.21 with AdamW under an AVX2 cap, round 25), and
    `DFLASH_AUTO_DTYPE` pins it."""
    if device.type == "cuda":
        return torch.bfloat16
    from dflash_train.machine import auto_dtype

    return torch.bfloat16 if device.type == "cpu" and auto_dtype(device)[0] == "bfloat16" else torch.float32


class DeviceMuon(DeviceAdamW):
    """Muon for the hidden matrices, DeviceAdamW (its masters, clip and schedule) for everything else.

    `matrices`: the parameters (of `params`) that step with Muon: the draft layers' projections and `fc`; the
    LM head, the norms' gains and anything else keep AdamW, as Muon's authors use it. Each Muon step: the
    (clipped) gradient into a momentum buffer, its Nesterov blend orthogonalised (`orthogonalize`), scaled by
    0.2 sqrt(max(rows, cols)) so its RMS matches an AdamW update's (the same lr serves both rules, as
    torch.optim.Muon's `match_rms_adamw`; `lr_scale` multiplies it), with decoupled weight decay. The
    learning-rate schedule scales both rules: they share the optimizer's param groups. `variant="normuon"`
    (NorMuon) divides the orthogonalised update by a running RMS per neuron before the scaling (`_per_neuron`)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], matrices: Iterable[torch.nn.Parameter], *, lr: float,
                 betas: tuple[float, float], weight_decay: float, grad_clip: float, fp32_masters: bool,
                 decay_on: str = "matrices", momentum: float = 0.95, ns_steps: int = 5, every: int = 1,
                 lr_scale: float = 1.0, variant: str = "muon"):
        params = list(params)
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, grad_clip=grad_clip,
                         fp32_masters=fp32_masters, decay_on=decay_on)
        chosen = {id(p) for p in matrices}
        self.muon_masters = [m for p, m in zip(self.model_params, self.masters, strict=True)
                             if id(p) in chosen and p.ndim == 2]
        if not self.muon_masters:
            raise ValueError("optim.algorithm is muon, but the drafter has no trainable matrix for it (its layers' "
                             "projections and fc); use adamw")
        self.momentum = float(momentum)
        self.ns_steps = int(ns_steps)
        if every < 1:
            raise ValueError(f"optim.muon_every is {every}; use 1 (orthogonalise every step) or more")
        self.every = int(every)
        if lr_scale <= 0:
            raise ValueError(f"optim.muon_lr_scale is {lr_scale}; use a positive factor (1: Muon's update has AdamW's RMS)")
        self.lr_scale = float(lr_scale)
        if variant not in ("muon", "normuon"):
            raise ValueError(f"optim.muon_variant is {variant!r}; use muon or normuon")
        self.variant = variant
        self.ns_dtype = muon_dtype(self.muon_masters[0].device)
        self.muon_weight_decay = float(weight_decay)
        # the momentum buffers live beside AdamW's state, not in it (AdamW's loader expects its own keys there)
        self.muon_momentum: list[torch.Tensor | None] = [None] * len(self.muon_masters)
        # normuon: each matrix's running mean square of its orthogonalised update, one value per neuron
        self.muon_second: list[torch.Tensor | None] = [None] * len(self.muon_masters)
        # `every` > 1: the orthogonalised update of the last refresh, applied until the next (in the iteration's
        # dtype, which holds it exactly), and the Muon steps taken so far (which steps refresh)
        self.muon_direction: list[torch.Tensor | None] = [None] * len(self.muon_masters)
        self.muon_steps = 0

    def _step_matrices(self, coef: torch.Tensor | None) -> None:
        live = [(i, m) for i, m in enumerate(self.muon_masters) if m.grad is not None]
        if not live:
            return
        lr = self._group_of(live[0][1])["lr"]
        grads = [m.grad for _, m in live]
        if coef is not None:
            grads = torch._foreach_mul(grads, coef)
        for i, m in live:
            if self.muon_momentum[i] is None:
                self.muon_momentum[i] = torch.zeros_like(m)
        bufs = [self.muon_momentum[i] for i, _ in live]
        torch._foreach_lerp_(bufs, grads, 1 - self.momentum)
        refresh = self.muon_steps % self.every == 0 or any(self.muon_direction[i] is None for i, _ in live)
        self.muon_steps += 1
        if refresh:
            directions = self._orthogonalized(live, torch._foreach_lerp(grads, bufs, self.momentum))  # Nesterov
            if self.variant == "normuon":
                directions = self._per_neuron(live, directions)
            if self.every > 1:
                for (i, _), d in zip(live, directions, strict=True):
                    self.muon_direction[i] = d.to(self.ns_dtype)
        else:  # between refreshes: the last direction again (the momentum above still takes every gradient)
            directions = [self.muon_direction[i].float() for i, _ in live]
        masters = [m for _, m in live]
        if self.muon_weight_decay:
            torch._foreach_mul_(masters, 1 - lr * self.muon_weight_decay)
        for (_, m), d in zip(live, directions, strict=True):
            m.add_(d, alpha=-lr * self.lr_scale * 0.2 * max(m.shape) ** 0.5)
        for _, m in live:
            m.grad = None  # AdamW skips it

    def _orthogonalized(self, live: list[tuple[int, torch.Tensor]], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each update orthogonalised (fp32, each in its matrix's shape). Matrices of one shape up to a transpose
        (gate, up and down; q and o; k and v) take one batched iteration: the same maths in a few large matmuls
        instead of many small ones (kernel launches on a GPU)."""
        shapes: dict[tuple[int, int], list[int]] = {}
        for k, (_, m) in enumerate(live):
            shapes.setdefault((min(m.shape), max(m.shape)), []).append(k)
        out: list[torch.Tensor | None] = [None] * len(live)
        for (short, _), ks in shapes.items():
            wide = torch.stack([updates[k] if updates[k].shape[0] == short else updates[k].mT for k in ks])
            for k, o in zip(ks, orthogonalize(wide, self.ns_steps, self.ns_dtype), strict=True):
                out[k] = o if live[k][1].shape[0] == short else o.mT
        return out

    def _per_neuron(self, live: list[tuple[int, torch.Tensor]], directions: list[torch.Tensor],
                    beta2: float = 0.95) -> list[torch.Tensor]:
        """NorMuon's step: each orthogonalised update divided, neuron by neuron, by the root of a running mean
        (beta2) of its squares, then scaled back to its own norm. A neuron is an index of the matrix's long side
        (a square or tall matrix's rows, a wide one's columns), its mean taken over the short side: the short
        side's vectors leave the iteration with about equal norms, the long side's do not. With `every` > 1 the
        mean moves at the refreshes only."""
        out = []
        for (i, _), d in zip(live, directions, strict=True):
            square = d.square().mean(dim=-1 if d.shape[0] >= d.shape[1] else 0, keepdim=True)
            if self.muon_second[i] is None:
                self.muon_second[i] = torch.zeros_like(square)
            self.muon_second[i].lerp_(square, 1 - beta2)
            n = d / (self.muon_second[i].sqrt() + 1e-10)
            out.append(n * (torch.linalg.vector_norm(d) / (torch.linalg.vector_norm(n) + 1e-10)))
        return out

    def _group_of(self, p: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["muon_momentum"] = [None if b is None else b.detach().clone() for b in self.muon_momentum]
        if self.every > 1:
            sd["muon_direction"] = [None if d is None else d.detach().clone() for d in self.muon_direction]
        sd["muon_steps"] = self.muon_steps
        if self.variant == "normuon":
            sd["muon_second"] = [None if v is None else v.detach().clone() for v in self.muon_second]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        momentum = state_dict.pop("muon_momentum", None)
        if momentum is None or len(momentum) != len(self.muon_masters):
            raise ValueError("optimizer state without Muon's momentum for these matrices (saved with optim.algorithm "
                             "adamw, or another drafter); resume with the settings the run was started with")
        direction = state_dict.pop("muon_direction", None)
        steps = state_dict.pop("muon_steps", None)
        second = state_dict.pop("muon_second", None)
        if self.variant == "normuon" and (second is None or len(second) != len(self.muon_masters)):
            raise ValueError("optimizer state without NorMuon's per-neuron mean squares (saved with optim.muon_variant "
                             "muon); resume with the settings the run was started with")
        if self.every > 1 and (direction is None or steps is None):
            raise ValueError("optimizer state without Muon's last orthogonalised update (saved with another "
                             "optim.muon_every); resume with the settings the run was started with")
        super().load_state_dict(state_dict)
        self.muon_momentum = [None if b is None else b.to(m.device, m.dtype).clone()
                              for b, m in zip(momentum, self.muon_masters, strict=True)]
        if self.every > 1:
            self.muon_direction = [None if d is None else d.to(m.device, self.ns_dtype).clone()
                                   for d, m in zip(direction, self.muon_masters, strict=True)]
        self.muon_steps = int(steps or 0)
        if self.variant == "normuon":
            self.muon_second = [None if v is None else v.to(m.device, torch.float32).clone()
                                for v, m in zip(second, self.muon_masters, strict=True)]


MUON_NEEDS_OWN_STEP = ("optim.algorithm: muon runs as the toolkit's own optimizer step, not DeepSpeed's: set "
                       "engine.zero_stage: 0 and engine.optimizer: torch, or use adamw")


def build_optimizer(params: list[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
                    weight_decay: float, grad_clip: float, own_step: bool, fp32_masters: bool,
                    decay_on: str = "matrices", muon: list[torch.nn.Parameter] | None = None,
                    muon_momentum: float = 0.95, muon_ns_steps: int = 5, muon_every: int = 1,
                    muon_lr_scale: float = 1.0, muon_variant: str = "muon"):
    """`own_step` (no ZeRO): a DeviceAdamW that clips on the device, or a DeviceMuon when `muon` names the
    matrices Muon steps. Otherwise torch's AdamW for DeepSpeed's ZeRO optimizers to wrap (fused on CUDA; they
    clip themselves)."""
    if muon is not None and not own_step:
        raise ValueError(MUON_NEEDS_OWN_STEP)
    if muon is not None:
        return DeviceMuon(params, muon, lr=lr, betas=betas, weight_decay=weight_decay, grad_clip=grad_clip,
                          fp32_masters=fp32_masters, decay_on=decay_on, momentum=muon_momentum,
                          ns_steps=muon_ns_steps, every=muon_every, lr_scale=muon_lr_scale,
                          variant=muon_variant)
    if own_step:
        return DeviceAdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, grad_clip=grad_clip,
                           fp32_masters=fp32_masters, decay_on=decay_on)
    fused = torch.cuda.is_available() and fused_for(params)
    return torch.optim.AdamW(decay_groups(params, weight_decay, decay_on), lr=lr, betas=betas,
                             weight_decay=weight_decay, fused=fused or None)
