"""Which attention backend the draft gets, from the device that will run it.

DFlash attends non-causally inside the draft block, so the draft needs a backend that
supports it (formats.md §5). `draft_attention_backend` is a pure function of the device;
`probe_device` is the only part that looks at the machine.
"""

from __future__ import annotations

import shutil
import subprocess

# a device: (major, minor) compute capability of GPU 0, or "cpu" (vLLM's CPU build / no GPU)
Device = tuple[int, int] | str

CPU = "cpu"
# FlashAttention in vLLM: Ampere sm80/86, Ada sm89, Hopper sm90, Blackwell sm100/sm120 families
FLASH_ATTN_CAPABILITIES = {(8, 0), (8, 6), (8, 9), (9, 0)}
FLASH_ATTN_MAJORS = {10, 12}
NON_CAUSAL_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "CPU_ATTN",
                       "ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN")


def draft_attention_backend(device: Device) -> str:
    """FLASH_ATTN on Ampere/Ada/Hopper/Blackwell, CPU_ATTN on CPU, FLEX_ATTENTION otherwise."""
    if device == CPU:
        return "CPU_ATTN"
    major, minor = device  # type: ignore[misc]
    if (major, minor) in FLASH_ATTN_CAPABILITIES or major in FLASH_ATTN_MAJORS:
        return "FLASH_ATTN"
    return "FLEX_ATTENTION"


def describe(device: Device) -> str:
    return "CPU (vLLM CPU build or no GPU)" if device == CPU else f"GPU sm{device[0]}{device[1]}"


def parse_compute_cap(text: str) -> tuple[int, int] | None:
    """`nvidia-smi --query-gpu=compute_cap` output ("9.0\\n9.0") -> (9, 0) for the first GPU."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            try:
                major, minor = line.split(".", 1)
                return int(major), int(minor)
            except ValueError:
                return None
    return None


def probe_device() -> Device:
    """GPU 0's compute capability via torch.cuda, else nvidia-smi, else "cpu"."""
    try:
        import torch

        if torch.cuda.is_available():
            return tuple(torch.cuda.get_device_capability(0))  # type: ignore[return-value]
    except Exception:  # a broken CUDA install must not stop a CPU serve
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=False)
            cap = parse_compute_cap(out.stdout) if out.returncode == 0 else None
            if cap:
                return cap
        except (OSError, subprocess.TimeoutExpired):
            pass
    return CPU
