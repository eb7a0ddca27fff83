"""The step's device choices: attention and LM-head chunk resolved per device, flex refused without
CUDA, an out-of-memory step reported as a ConfigError naming the micro-batch size and the memory, and the C
heap's freed memory given back by a trim."""

import sys
from pathlib import Path

import pytest
import torch

from dflash_train.errors import ConfigError
from dflash_train.train.device import (
    StepKernels,
    oom_guard,
    oom_message,
    requested_bytes,
    resolve_attention,
    step_kernels,
)
from dflash_train.train.recipe import load_recipe

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.12 GiB is free. Including non-PyTorch memory, this process has 78.06 GiB memory in use.")


def _recipe(*overrides):
    return load_recipe(None, list(overrides), base={"data": {"prepared": "rows"}}).recipe


def test_auto_is_flex_on_cuda_and_split_on_cpu():
    assert resolve_attention("auto", "cuda") == "flex" and resolve_attention("auto", "cpu") == "split"
    assert [resolve_attention(a, "cpu") for a in ("split", "dense")] == ["split", "dense"]
    assert resolve_attention("flex", torch.device("cuda", 0)) == "flex"
    assert _recipe().objective.attention == "auto" and _recipe().objective.logits_chunk == "auto"


def test_flex_without_cuda_names_the_field_and_the_choices():
    with pytest.raises(ConfigError) as err:
        resolve_attention("flex", "cpu")
    msg = str(err.value)
    assert msg.startswith("objective.attention: flex") and "auto" in msg and "split" in msg


def test_step_kernels_resolve_auto_for_the_device():
    assert step_kernels(_recipe(), "cpu", 49152) == StepKernels("split", 1024, "eager", "eager")
    assert step_kernels(_recipe(), "cuda", 49152) == StepKernels("flex", 4352, "compiled", "compiled")
    assert step_kernels(_recipe("objective.logits_chunk=300", "objective.attention=dense", "objective.head=eager"),
                        "cuda", 49152) == StepKernels("dense", 300, "eager", "compiled")
    assert step_kernels(_recipe("objective.head=compiled"), "cpu", 49152).head == "compiled"
    assert step_kernels(_recipe("objective.layer_kernels=compiled"), "cpu", 49152).layers == "compiled"
    assert step_kernels(_recipe("engine.zero_stage=3"), "cuda", 49152).layers == "eager"  # gathers in every call
    with pytest.raises(ConfigError, match="objective.layer_kernels"):
        _recipe("objective.layer_kernels=liger")
    with pytest.raises(ConfigError, match="objective.logits_chunk"):
        _recipe("objective.logits_chunk=0")
    with pytest.raises(ConfigError, match="objective.head"):
        _recipe("objective.head=triton")


def test_requested_bytes_reads_the_cuda_message():
    assert requested_bytes(CUDA_OOM) == int(2.5 * 2**30)
    assert requested_bytes("Tried to allocate 512.00 MiB") == 512 * 2**20
    assert requested_bytes("some other failure") is None


def test_oom_message_names_the_micro_batch_and_the_memory_it_needed():
    recipe = _recipe("batch.tokens_per_microbatch=3072")
    msg = oom_message(recipe, "cuda:0", requested=int(2.5 * 2**30), peak=76 * 2**30, total=int(79.19 * 2**30))
    assert msg.startswith("batch.tokens_per_microbatch 3072:")
    assert "needed at least 78.5 GiB" in msg and "cuda:0 holds 79.2 GiB" in msg
    assert "engine.activation_checkpointing: true" in msg
    on = oom_message(_recipe("engine.activation_checkpointing=true"), "cuda:0", None, None, None)
    assert "activation_checkpointing" not in on and "lower batch.tokens_per_microbatch" in on


def test_oom_in_a_step_becomes_a_config_error_without_the_cuda_trace():
    recipe = _recipe("batch.tokens_per_microbatch=8192")
    with pytest.raises(ConfigError) as err:
        with oom_guard(recipe, "cpu"):
            raise torch.OutOfMemoryError(CUDA_OOM)
    assert "batch.tokens_per_microbatch 8192" in str(err.value) and "2.50 GiB" in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__
    with pytest.raises(ValueError):  # other errors pass through untouched
        with oom_guard(recipe, "cpu"):
            raise ValueError("not memory")


def test_a_drafter_that_cannot_fit_is_refused_naming_its_size_and_zero_shards_it():
    from dflash_train.train.device import check_drafter_fits

    gib = 2**30
    check_drafter_fits(_recipe(), 10**9, "cpu", 1, memory=16 * gib)  # 1B parameters: 14.9 GiB of state, fits
    with pytest.raises(ConfigError, match=r"drafter.num_layers 1: the drafter has 2.00B parameters, and training "
                                          r"them needs at least 29.8 GiB .*; cpu holds 16.0 GiB.*engine.zero_stage"):
        check_drafter_fits(_recipe(), 2 * 10**9, "cpu", 1, memory=16 * gib)
    check_drafter_fits(_recipe("engine.zero_stage=1"), 2 * 10**9, "cuda", 8, memory=16 * gib)  # 3.7 GiB a rank
    with pytest.raises(ConfigError, match=r"needs at least 37.3 GiB \(weights, gradients and AdamW state per rank\)"):
        check_drafter_fits(_recipe("engine.zero_stage=2"), 20 * 10**9, "cuda", 8, memory=16 * gib)


HEAP_HOLES = """
import json, sys
sys.path.insert(0, {root!r})
from dflash_train.train.device import trim_host_heap

def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:")) / 1024  # MiB

blocks = [bytearray(b"x" * 100_000) for _ in range(3000)]  # ~286 MiB of heap chunks (below the mmap threshold)
held = blocks[::10]  # one block in ten kept: the freed ones are holes inside the heap, not at its top
del blocks
freed = anon()
trimmed = trim_host_heap()
print(json.dumps({{"freed": freed, "after": anon(), "trimmed": trimmed, "held": len(held)}}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux")
def test_a_trim_gives_the_heaps_freed_holes_back_to_the_system():
    """~257 MiB freed between live blocks stays resident (glibc keeps its arenas) until the trim returns it."""
    import json
    import subprocess

    root = str(Path(__file__).resolve().parents[3])
    out = subprocess.run([sys.executable, "-c", HEAP_HOLES.format(root=root)], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout)
    assert got["trimmed"] is True and got["held"] == 300
    assert got["freed"] - got["after"] > 200, got  # MiB given back
