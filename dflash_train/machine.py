"""The machine a measurement ran on (CPU model, cores, bf16 instructions, GPU), and the dtype that
`auto` picks on it.

CPU timings differ by more than a recipe change between machines of one kind: the demo's
stages ran 1.35-1.7x slower on cores with AVX512-BF16 and no AMX than on the machine of an
earlier measurement. Summaries that carry times (the demo's, a sweep's) record these facts
beside them, so two numbers are compared only when they come from like machines.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from dflash_train.errors import ConfigError

# the CPU instructions that decide how fast bf16 matmuls run on a CPU
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")
# ONEDNN_MAX_CPU_ISA values (oneDNN's cap on the instructions its kernels use) that leave bf16 its own
BF16_ISA_WORDS = ("BF16", "AMX", "FP16", "AVX10", "ALL", "DEFAULT")


def cpu_facts(cpuinfo: str) -> dict:
    """Model name and bf16 instructions from the text of /proc/cpuinfo (its first processor)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "bf16_instructions": [f for f in BF16_FLAGS if f in flags]}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_facts() -> dict:
    import torch

    info = Path("/proc/cpuinfo")
    facts = cpu_facts(info.read_text(errors="replace")) if info.is_file() else cpu_facts("")
    facts.update(cores=usable_cores(), torch_threads=torch.get_num_threads(), torch=torch.__version__)
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def describe(facts: dict) -> str:
    """One line for a table: 'Intel(R) Xeon(R) Processor, 2 cores, bf16 instructions: avx512_bf16'."""
    bf16 = ", ".join(facts.get("bf16_instructions") or []) or "none"
    gpu = f", {facts['gpu']}" if facts.get("gpu") else ""
    return f"{facts.get('cpu')}, {facts.get('cores')} cores, bf16 instructions: {bf16}{gpu}"


def cpu_bf16_instructions() -> list[str]:
    info = Path("/proc/cpuinfo")
    return cpu_facts(info.read_text(errors="replace"))["bf16_instructions"] if info.is_file() else []


def cpu_amx(bf16_instructions: list[str] | None = None, isa_cap: str | None = None) -> bool:
    """Whether this CPU's bf16 matmuls run on AMX tiles: it has amx_bf16 and $ONEDNN_MAX_CPU_ISA (or `isa_cap`)
    does not keep oneDNN below them."""
    flags = cpu_bf16_instructions() if bf16_instructions is None else bf16_instructions
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA", "") if isa_cap is None else isa_cap).upper()
    return "amx_bf16" in flags and (not cap or "AMX" in cap or cap in ("ALL", "DEFAULT"))


def auto_dtype(device, bf16_instructions: list[str] | None = None, isa_cap: str | None = None) -> tuple[str, str]:
    """(dtype, why) for `auto`: bfloat16 on CUDA and on CPUs with bf16 instructions (AVX512-BF16, AMX),
    float32 on the others, where bf16 matmuls are emulated: on 2 AVX2-only cores the demo's bf16
    regeneration ran 5x slower than float32. `isa_cap` (default $ONEDNN_MAX_CPU_ISA): a cap below the
    bf16 instructions makes oneDNN emulate them too. $DFLASH_AUTO_DTYPE (float32, bfloat16) pins the
    CPU's pick: a fleet of mixed machines, or a test suite whose expected numbers are float32's."""
    if str(device).startswith("cuda"):
        return "bfloat16", "CUDA"
    pinned = os.environ.get("DFLASH_AUTO_DTYPE")
    if pinned:
        if pinned not in ("float32", "bfloat16"):
            raise ConfigError(f"DFLASH_AUTO_DTYPE={pinned!r}: set float32 or bfloat16, or unset it")
        return pinned, f"DFLASH_AUTO_DTYPE={pinned}"
    flags = cpu_bf16_instructions() if bf16_instructions is None else bf16_instructions
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA", "") if isa_cap is None else isa_cap).upper()
    if not flags:
        return "float32", "this CPU has no bf16 instructions (avx512_bf16, amx)"
    if cap and not any(word in cap for word in BF16_ISA_WORDS):
        return "float32", f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off this CPU's {', '.join(flags)}"
    return "bfloat16", f"this CPU has {', '.join(flags)}"
