"""DeepSpeed as the training engine: process group, engine, optimizer and schedule.

Single process by default: without a launcher we create a gloo world of one ourselves. Under
`deepspeed` or `torchrun` the launcher's environment gives rank and world. DeepSpeed's communication
backend compiles a C++ shared-memory all-reduce op on a CPU the first time it starts on a machine
(52 s on a fresh 2-core machine, the first `make demo`'s whole setup lap); a world of one reduces
nothing, so there it starts without that op (`_without_shm_op`). DeepSpeed is told the trainer's device
(`pin_deepspeed_accelerator`): left to itself it prefers an Apple or Intel GPU where torch sees one, and would
move the drafter there while the batches stay on the CPU.
The optimizer is handed to DeepSpeed as the client optimizer (no op build). Without ZeRO it is the
toolkit's `DeviceAdamW` (train/optimizer.py: fp32 masters, fused AdamW, the gradient clip on the
device), and DeepSpeed's bf16 mode and clipping are off so that DeepSpeed does not wrap it in its
`FP16_UnfusedOptimizer` (a host wait per parameter per step); the drafter is cast to bf16 here
instead. With ZeRO 1-3 it is torch's AdamW (fused on CUDA) inside DeepSpeed's ZeRO optimizer.
`engine.optimizer: deepspeed` selects DeepSpeed's own fused/CPU Adam instead.
"""

from __future__ import annotations

import atexit
import importlib
import math
import os
import socket
import sys
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from dflash_train.errors import ConfigError
from dflash_train.train.recipe import TrainRecipe


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> World:
    import torch.distributed as dist

    # a single process sets the launcher's variables for itself; a child process inherits them (a test or a
    # command that starts another `dflash-train`), and must not take them for a launch: their port is the
    # parent's, still bound. A real launcher sets a MASTER_PORT of its own.
    inherited = os.environ.get("DFLASH_SINGLE_PROCESS_PORT") == os.environ.get("MASTER_PORT") \
        and not dist.is_initialized()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ and not inherited
    if not launched:
        port = os.environ["MASTER_PORT"] if dist.is_initialized() else str(_free_port())
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": port, "DFLASH_SINGLE_PROCESS_PORT": port})
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(_destroy_process_group)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    pin_deepspeed_accelerator(device)
    return World(dist.get_rank(), dist.get_world_size(), local_rank, device)


def pin_deepspeed_accelerator(device: torch.device) -> None:
    """DeepSpeed's accelerator set to the trainer's device (`cuda` or `cpu`). DeepSpeed picks one when it is
    first used, and takes an Apple GPU (`mps`) or an Intel GPU (`xpu`) before the CPU wherever torch has one: its
    engine would then move the drafter to that GPU while the trainer's batches stay on the CPU (every `make demo`
    on an Apple-silicon Mac). $DS_ACCELERATOR set to another device is refused by name, unless a parent
    `dflash-train` set it (a CUDA run's child with the GPU hidden trains on the CPU)."""
    want = device.type
    chosen = os.environ.get("DS_ACCELERATOR")
    inherited = chosen is not None and chosen == os.environ.get("DFLASH_DS_ACCELERATOR")  # our pin, not the user's
    if chosen and chosen != want and not inherited:
        raise ConfigError(f"DS_ACCELERATOR={chosen}: dflash-train trains on {want} here (CUDA when torch sees a "
                          f"CUDA GPU, else the CPU) and DeepSpeed must use the same device; unset DS_ACCELERATOR or "
                          f"set DS_ACCELERATOR={want}")
    os.environ["DS_ACCELERATOR"] = os.environ["DFLASH_DS_ACCELERATOR"] = want
    if "deepspeed" in sys.modules:  # imported before the trainer started: its pick may be made already
        from deepspeed.accelerator import get_accelerator, set_accelerator

        if get_accelerator().device_name() != want:
            module = importlib.import_module(f"deepspeed.accelerator.{want}_accelerator")
            set_accelerator(getattr(module, f"{want.upper()}_Accelerator")())


def _destroy_process_group() -> None:
    """Tear the group down before the interpreter does: a gloo group left to static destruction can abort
    the process after its work is done ("terminate called without an active exception", exit -6)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(value: float | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """`value` summed over ranks: a float64 scalar tensor on `device` (the rank's training device, as
    nccl needs). Nothing is read back to the host; the caller reads it when it needs the number."""
    import torch.distributed as dist

    if isinstance(value, torch.Tensor):
        t = value.detach().to(device=device, dtype=torch.float64, copy=True)
    else:  # a fill on the device, not a copy from pageable host memory
        t = torch.full((), float(value), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def use_bf16(recipe: TrainRecipe) -> bool:
    """DeepSpeed's bf16 mode: the engine holds the weights in bf16 (bf16-mixed keeps them fp32)."""
    p = recipe.engine.precision
    return p == "bf16" or (p == "auto" and torch.cuda.is_available())


def forward_precision(recipe: TrainRecipe, device: torch.device):
    """The context the drafter's forward runs in: torch.autocast to bf16 under `bf16-mixed`, else
    nothing (fp32 runs as it is; DeepSpeed's bf16 casts the weights themselves)."""
    if recipe.engine.precision != "bf16-mixed":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def lr_lambda(total_steps: int, warmup_ratio: float, schedule: str, min_ratio: float):
    warmup = int(math.ceil(total_steps * warmup_ratio))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if schedule == "linear":
            return min_ratio + (1 - min_ratio) * (1 - progress)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def own_step(recipe: TrainRecipe) -> bool:
    """Whether the optimizer step is the toolkit's DeviceAdamW (no ZeRO, torch optimizer): DeepSpeed then
    neither clips nor runs its bf16 wrapper, and the drafter's bf16 weights are cast by build_engine."""
    return recipe.engine.zero_stage == 0 and recipe.engine.optimizer == "torch"


def deepspeed_config(recipe: TrainRecipe) -> dict:
    own = own_step(recipe)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": recipe.batch.grad_accum,
        "gradient_clipping": 0.0 if own else recipe.optim.grad_clip,  # DeviceAdamW clips on the device
        "zero_optimization": {"stage": recipe.engine.zero_stage},
        "bf16": {"enabled": use_bf16(recipe) and not own},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if recipe.engine.optimizer == "deepspeed":
        o = recipe.optim
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas),
                                                       "weight_decay": o.weight_decay}}
    return cfg


# the groups of matrices `optim.muon_on` can give Muon, by their names in the checkpoint
MUON_GROUPS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj"),
               "fc": ()}


def muon_matrices(model: torch.nn.Module, on: Iterable[str] = tuple(MUON_GROUPS)) -> list[torch.nn.Parameter]:
    """The weights `optim.algorithm: muon` steps with Muon: of the trainable matrices of the draft layers
    (`attention`: q/k/v/o, `mlp`: gate/up/down) and `fc` (the feature projection), the groups in `on`; never the
    LM head (Muon's authors keep embeddings and heads on AdamW) nor the norms."""
    on = set(on)
    unknown = on - set(MUON_GROUPS)
    if unknown:
        raise ValueError(f"optim.muon_on: unknown group(s) {sorted(unknown)}; choose from {list(MUON_GROUPS)}")

    def takes(name: str) -> bool:
        if name.startswith("fc."):
            return "fc" in on
        return name.startswith("layers.") and any(f".{proj}." in name for group in on for proj in MUON_GROUPS[group])

    return [p for name, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and takes(name)]


@contextmanager
def _without_shm_op():
    """DeepSpeed's communication backend started without its CPU shared-memory op where this process is the
    whole world: `TorchBackend` builds the op when it starts (a C++ compile on a machine's first run) and uses
    it only to all-reduce between ranks on one host. A GPU's backend builds nothing; a CPU world of several
    ranks keeps the op."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        yield
        return
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # the name `torch` in deepspeed.comm is torch
    build = ds_torch_comm.build_shm_op
    ds_torch_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch_comm.build_shm_op = build


def build_engine(model: torch.nn.Module, recipe: TrainRecipe, total_steps: int):
    """(engine, scheduler). The scheduler steps once per optimizer step, inside engine.step()."""
    import deepspeed

    from dflash_train.train.optimizer import build_optimizer, decay_groups

    params = [p for p in model.parameters() if p.requires_grad]
    o = recipe.optim
    optimizer = None
    own, bf16 = own_step(recipe), use_bf16(recipe)
    muon = muon_matrices(model, o.muon_on) if o.algorithm == "muon" else None  # the recipe refuses it without own_step
    if recipe.engine.optimizer == "torch":  # masters are taken from the fp32 weights, before any cast
        optimizer = build_optimizer(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                                    grad_clip=o.grad_clip, own_step=own, fp32_masters=own and bf16,
                                    decay_on=o.weight_decay_on, muon=muon, muon_momentum=o.muon_momentum,
                                    muon_ns_steps=o.muon_ns_steps, muon_every=o.muon_every,
                                    muon_lr_scale=o.muon_lr_scale, muon_variant=o.muon_variant)
    if own and bf16:  # what DeepSpeed's bf16 mode does to the module: the weights, not the fp32 buffers
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.data = p.data.to(torch.bfloat16)
    scheduler_fn = lr_lambda(total_steps, o.warmup_ratio, o.schedule, o.min_lr_ratio)

    def make_scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, scheduler_fn)

    # DeepSpeed's own AdamW (engine.optimizer: deepspeed) takes the decay's groups from the parameters it is given
    groups = params if optimizer is not None else decay_groups(params, o.weight_decay, o.weight_decay_on)
    with _without_shm_op():
        engine, _, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=groups, optimizer=optimizer, config=deepspeed_config(recipe),
            lr_scheduler=make_scheduler, dist_init_required=False)
    if engine.zero_optimization_stage() == 0 and engine.dp_world_size == 1:
        # one rank has nothing to reduce, but DeepSpeed still flattens every gradient into one buffer after the
        # backward, all-reduces it with itself and copies it back: 15-30 ms of a ~450 ms CPU demo step, and a
        # second copy of the gradients on a GPU
        engine.enable_backward_allreduce = False
    return engine, scheduler


@contextmanager
def gathered_params(engine):
    """Full parameters on every rank for the duration (ZeRO-3 partitions them)."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            yield
    else:
        yield
