"""The machine a measurement ran on: CPU model, cores, bf16 instructions, GPU.

CPU timings differ by more than a recipe change between machines of one kind: the demo's
stages ran 1.35-1.7x slower on cores with AVX512-BF16 and no AMX than on the machine of an
earlier measurement. Summaries that carry times (the demo's, a sweep's) record these facts
beside them, so two numbers are compared only when they come from like machines.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# the CPU instructions that decide how fast bf16 matmuls run on a CPU
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


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


def machine_facts() -> dict:
    import torch

    info = Path("/proc/cpuinfo")
    facts = cpu_facts(info.read_text(errors="replace")) if info.is_file() else cpu_facts("")
    facts.update(cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__)
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def describe(facts: dict) -> str:
    """One line for a table: 'Intel(R) Xeon(R) Processor, 2 cores, bf16 instructions: avx512_bf16'."""
    bf16 = ", ".join(facts.get("bf16_instructions") or []) or "none"
    gpu = f", {facts['gpu']}" if facts.get("gpu") else ""
    return f"{facts.get('cpu')}, {facts.get('cores')} cores, bf16 instructions: {bf16}{gpu}"
