"""What the training step takes from the device it runs on: the attention kernel, the LM-head chunk
and its epilogue, the draft layers' fused ops (both compiled on a CUDA GPU) for that device, and the
errors for a micro-batch or a drafter that does not fit in its memory, and what a released model or a CPU
step's freed buffers give back to the device or the system.

`objective.attention: auto` is compiled flex attention on a CUDA GPU and the exact split
attention on CPU. Flex attention is only ever run compiled (model/flex.py); torch has no
flex-attention backward on CPU, so `flex` without CUDA is refused before anything loads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dflash_train.errors import ConfigError
from dflash_train.train.loss import auto_logits_chunk
from dflash_train.train.recipe import TrainRecipe

ATTENTION_CHOICES = ("auto", "split")  # what to suggest when flex cannot run here


@dataclass(frozen=True)
class StepKernels:
    attention: str  # split | dense | flex (auto resolved)
    logits_chunk: int
    head: str = "eager"  # eager | compiled (auto resolved): the LM head's per-chunk epilogue
    layers: str = "eager"  # eager | compiled (auto resolved): the draft layers' RMSNorm, SwiGLU, RoPE
    forward: str = "eager"  # eager | compiled (auto resolved): the training forward as one graph (compiled_step)


def resolve_attention(choice: str, device: torch.device | str) -> str:
    cuda = torch.device(device).type == "cuda"
    if choice == "auto":
        return "flex" if cuda else "split"
    if choice == "flex" and not cuda:
        raise ConfigError(f"objective.attention: flex needs a CUDA GPU (torch has no flex-attention backward on "
                          f"{torch.device(device).type}); use {' or '.join(ATTENTION_CHOICES)} (split here)")
    return choice


def step_kernels(recipe: TrainRecipe, device: torch.device | str, vocab: int) -> StepKernels:
    """The recipe's `auto` choices resolved for `device`; `vocab`: rows of the LM head."""
    o = recipe.objective
    chunk = auto_logits_chunk(vocab, device) if o.logits_chunk == "auto" else int(o.logits_chunk)
    return StepKernels(resolve_attention(o.attention, device), chunk, resolve_head(o.head, device),
                       resolve_layer_kernels(o.layer_kernels, device, recipe.engine.zero_stage))


HEAD_CHOICES = ("auto", "eager", "compiled")


def resolve_head(choice: str, device: torch.device | str) -> str:
    """`objective.head`: auto is compiled on a CUDA GPU, eager elsewhere (CPU keeps the eager head)."""
    if choice == "auto":
        return "compiled" if torch.device(device).type == "cuda" else "eager"
    if choice not in HEAD_CHOICES:
        raise ValueError(f"objective.head {choice!r}: choose one of {', '.join(HEAD_CHOICES)}")
    return choice


def resolve_layer_kernels(choice: str, device: torch.device | str, zero_stage: int) -> str:
    """`objective.layer_kernels`: auto is compiled on a CUDA GPU below ZeRO-3 (whose parameter gathers run
    inside every module call: kept eager, as DeepSpeed's own compile support expects), eager elsewhere."""
    if choice == "auto":
        return "compiled" if torch.device(device).type == "cuda" and zero_stage < 3 else "eager"
    return choice


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(message: str) -> int | None:
    """The failed request of a CUDA out-of-memory message ("Tried to allocate 2.50 GiB")."""
    m = re.search(r"Tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)", message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def oom_message(recipe: TrainRecipe, device: str, requested: int | None, peak: int | None,
                total: int | None) -> str:
    gib = 2**30
    parts = []
    if peak is not None and requested is not None:
        parts.append(f"it needed at least {(peak + requested) / gib:.1f} GiB ({peak / gib:.1f} GiB allocated at the "
                     f"peak, then {requested / gib:.2f} GiB more)")
    elif requested is not None:
        parts.append(f"an allocation of {requested / gib:.2f} GiB failed")
    if total is not None:
        parts.append(f"{device} holds {total / gib:.1f} GiB")
    fix = "lower batch.tokens_per_microbatch (or objective.anchors_per_document)"
    if not recipe.engine.activation_checkpointing:
        fix += ", or set engine.activation_checkpointing: true"
    detail = f" ({'; '.join(parts)})" if parts else ""
    return (f"batch.tokens_per_microbatch {recipe.batch.tokens_per_microbatch}: a training micro-batch does not fit "
            f"in the memory of {device}{detail}; {fix}")


def oom_error(exc: BaseException, recipe: TrainRecipe, device: torch.device | str) -> ConfigError:
    device = torch.device(device)
    peak = total = None
    if device.type == "cuda" and torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
    return ConfigError(oom_message(recipe, str(device), requested_bytes(str(exc)), peak, total))


TRAIN_BYTES_PER_PARAMETER = 16  # weights and gradients (bf16 or fp32), fp32 masters, AdamW's two moments


def device_memory(device: torch.device | str) -> int | None:
    """Total memory of a CUDA device, or the machine's RAM for the CPU (None where unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_drafter_fits(recipe: TrainRecipe, parameters: int, device: torch.device | str, world_size: int,
                       memory: int | None = None) -> None:
    """Refuse, before anything is allocated, a drafter whose training state cannot fit at all: 16 bytes per
    parameter, divided over the ranks under ZeRO (a lower bound: activations come on top). A typo such as
    drafter.num_layers: 1000 otherwise ends in the kernel's out-of-memory kill, with no message."""
    memory = device_memory(device) if memory is None else memory
    shards = world_size if recipe.engine.zero_stage >= 1 else 1
    needed = parameters * TRAIN_BYTES_PER_PARAMETER // shards
    if memory is None or needed <= memory:
        return
    d = recipe.drafter
    size = f"drafter.num_layers {d.num_layers}" + (f", drafter.intermediate_size {d.intermediate_size}"
                                                   if d.intermediate_size else "")
    per_rank = " per rank" if shards > 1 else ""
    shard = "" if recipe.engine.zero_stage else ", or shard it with engine.zero_stage"
    raise ConfigError(f"{size}: the drafter has {parameters / 1e9:.2f}B parameters, and training them needs at "
                      f"least {needed / 2**30:.1f} GiB (weights, gradients and AdamW state{per_rank}); "
                      f"{torch.device(device)} holds {memory / 2**30:.1f} GiB. Lower drafter.num_layers or "
                      f"drafter.intermediate_size{shard}")


def return_freed_memory(device: torch.device | str) -> None:
    """Collect what was just dropped (a model's modules hold reference cycles) and give it back: on CUDA the
    caching allocator's free blocks to the device, so its free memory reads what is left; on a CPU the C heap's
    free pages to the system."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    else:
        trim_host_heap()


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (AttributeError, OSError):
        return None


def trim_host_heap() -> bool:
    """Give the C heap's free pages back to the system. A CPU step frees its large temporary buffers into arenas
    glibc keeps, and a training process's resident memory grew with them through its run: ~1 GiB over the demo
    recipe's first 600 steps, a third of it given back by a trim every 50 steps at no cost to the step
    (docs/results/2026-12-07-trainer-heap-trim.md). False where there is no such call."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@contextmanager
def oom_guard(recipe: TrainRecipe, device: torch.device | str):
    """Turn an out-of-memory error inside the block into a ConfigError naming the micro-batch size."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise oom_error(exc, recipe, device) from None
