"""The machine a measurement ran on (CPU model, cores, bf16 instructions, GPU), and the dtype that
`auto` picks on it.

CPU timings differ by more than a recipe change between machines of one kind: the demo's
stages ran 1.35-1.7x slower on cores with AVX512-BF16 and no AMX than on the machine of an
earlier measurement. Summaries that carry times (the demo's, a sweep's) record these facts
beside them, so two numbers are compared only when they come from like machines.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

from dflash_train.errors import ConfigError

# the CPU instructions that decide how fast bf16 matmuls run on a CPU: x86's /proc/cpuinfo `flags`
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")
# an Arm CPU's: the `Features` (hwcaps) of Linux's /proc/cpuinfo on aarch64 (Neoverse V1/V2/N2, Graviton 3/4, Grace),
# macOS's hw.optional.arm.FEAT_BF16 (Apple M2 and later)
ARM_BF16_FLAGS = ("bf16", "sme", "FEAT_BF16")
# ONEDNN_MAX_CPU_ISA values (oneDNN's cap on the instructions its kernels use) that leave bf16 its own
BF16_ISA_WORDS = ("BF16", "AMX", "FP16", "AVX10", "ALL", "DEFAULT")


def cpu_facts(cpuinfo: str) -> dict:
    """Model name and bf16 instructions from the text of /proc/cpuinfo (its first processor). x86 names its model
    and `flags`; aarch64 only its `Features` and the core's `CPU implementer` / `CPU part` codes, which name it here
    when nothing better does (`this_cpu` asks lscpu, which knows the codes' names)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split()) | set(fields.get("Features", "").split())
    arm_part = " ".join(f"{key} {fields[key]}" for key in ("CPU implementer", "CPU part") if key in fields)
    return {"cpu": fields.get("model name") or arm_part or platform.processor() or platform.machine(),
            "bf16_instructions": [f for f in BF16_FLAGS + ARM_BF16_FLAGS if f in flags]}


def _command_output(*argv: str) -> str:
    """A system tool's stdout ('' where it is missing or fails): lscpu, sysctl."""
    import subprocess

    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _lscpu_model_name() -> str:
    for line in _command_output("lscpu").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name" and value.strip() not in ("", "-"):
            return value.strip()
    return ""


def this_cpu() -> dict:
    """`cpu_facts` of this machine (a copy: callers add to it)."""
    facts = _this_cpu()
    return {**facts, "bf16_instructions": list(facts["bf16_instructions"])}


@functools.cache
def _this_cpu() -> dict:
    """/proc/cpuinfo where there is one (an aarch64 core named by lscpu), else macOS's sysctl (the chip's name,
    FEAT_BF16), else the platform's words and no bf16 instructions. Read once a process."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        text = info.read_text(errors="replace")
        facts = cpu_facts(text)
        if "model name" not in text:
            facts["cpu"] = _lscpu_model_name() or facts["cpu"]
        return facts
    if platform.system() == "Darwin":
        name = _command_output("sysctl", "-n", "machdep.cpu.brand_string").strip()
        bf16 = _command_output("sysctl", "-n", "hw.optional.arm.FEAT_BF16").strip() == "1"
        return {"cpu": name or platform.machine(), "bf16_instructions": ["FEAT_BF16"] if bf16 else []}
    return cpu_facts("")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_facts() -> dict:
    import torch

    facts = this_cpu()
    facts.update(cores=usable_cores(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                 ram_gib=ram_gib())
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def ram_gib() -> float:
    """This machine's RAM in GiB."""
    import psutil

    from dflash_train.peak_memory import GIB

    return round(psutil.virtual_memory().total / GIB, 1)


def describe(facts: dict) -> str:
    """One line for a table: 'Intel(R) Xeon(R) Processor, 2 cores, 16.0 GiB RAM, bf16 instructions: avx512_bf16'
    (the RAM where the facts have it: summaries written before it was recorded do not)."""
    bf16 = ", ".join(facts.get("bf16_instructions") or []) or "none"
    gpu = f", {facts['gpu']}" if facts.get("gpu") else ""
    ram = f", {facts['ram_gib']} GiB RAM" if facts.get("ram_gib") else ""
    return f"{facts.get('cpu')}, {facts.get('cores')} cores{ram}, bf16 instructions: {bf16}{gpu}"


def cpu_bf16_instructions() -> list[str]:
    return this_cpu()["bf16_instructions"]


def cpu_amx(bf16_instructions: list[str] | None = None, isa_cap: str | None = None) -> bool:
    """Whether this CPU's bf16 matmuls run on AMX tiles: it has amx_bf16 and $ONEDNN_MAX_CPU_ISA (or `isa_cap`)
    does not keep oneDNN below them."""
    flags = cpu_bf16_instructions() if bf16_instructions is None else bf16_instructions
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA", "") if isa_cap is None else isa_cap).upper()
    return "amx_bf16" in flags and (not cap or "AMX" in cap or cap in ("ALL", "DEFAULT"))


def auto_dtype(device, bf16_instructions: list[str] | None = None, isa_cap: str | None = None) -> tuple[str, str]:
    """(dtype, why) for `auto`: bfloat16 on CUDA and on CPUs with bf16 instructions (AVX512-BF16, AMX),
    float32 on the others, where bf16 matmuls are emulated: on 2 AVX2-only cores the demo's bf16
    regeneration ran 5x slower than float32. Arm CPUs with bf16 (Graviton 3/4, Neoverse V/N2, Apple M2 and
    later) get float32 too until a run measures their bf16 against it: only x86 cores have been measured.
    `isa_cap` (default $ONEDNN_MAX_CPU_ISA): a cap below the bf16 instructions makes oneDNN emulate them too.
    $DFLASH_AUTO_DTYPE (float32, bfloat16) pins the CPU's pick: a fleet of mixed machines, or a test suite whose
    expected numbers are float32's."""
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
        return "float32", "this CPU has no bf16 instructions (avx512_bf16, amx; bf16 on Arm)"
    if not set(flags) & set(BF16_FLAGS):
        return "float32", (f"this Arm CPU has {', '.join(flags)}, but whether its bf16 matmuls beat float32 under "
                           "this torch is unmeasured: set DFLASH_AUTO_DTYPE=bfloat16 to try them "
                           "(`python bench/bench_features.py --dtypes` times both)")
    if cap and not any(word in cap for word in BF16_ISA_WORDS):
        return "float32", f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off this CPU's {', '.join(flags)}"
    return "bfloat16", f"this CPU has {', '.join(flags)}"
