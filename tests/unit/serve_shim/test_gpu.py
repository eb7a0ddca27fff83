"""The draft attention backend follows the GPU generation; probing is the only impure part."""

import shutil

import pytest

from serve_shim.gpu import CPU, NON_CAUSAL_BACKENDS, describe, draft_attention_backend, parse_compute_cap, probe_device


@pytest.mark.parametrize("device, backend", [
    ("cpu", "CPU_ATTN"),
    ((8, 0), "FLASH_ATTN"), ((8, 6), "FLASH_ATTN"), ((8, 9), "FLASH_ATTN"), ((9, 0), "FLASH_ATTN"),
    ((10, 0), "FLASH_ATTN"), ((10, 3), "FLASH_ATTN"), ((12, 0), "FLASH_ATTN"),
    ((7, 5), "FLEX_ATTENTION"), ((6, 1), "FLEX_ATTENTION"), ((8, 7), "FLEX_ATTENTION"), ((11, 0), "FLEX_ATTENTION"),
])
def test_backend_per_generation(device, backend):
    chosen = draft_attention_backend(device)
    assert chosen == backend and chosen in NON_CAUSAL_BACKENDS


def test_parse_compute_cap():
    assert parse_compute_cap("9.0\n9.0\n") == (9, 0)
    assert parse_compute_cap("\n12.0\n") == (12, 0)
    assert parse_compute_cap("") is None and parse_compute_cap("[N/A]") is None


def test_describe():
    assert describe(CPU) == "CPU (vLLM CPU build or no GPU)" and describe((9, 0)) == "GPU sm90"


def test_probe_on_this_machine():
    import torch

    device = probe_device()
    if not torch.cuda.is_available() and shutil.which("nvidia-smi") is None:
        assert device == CPU
    else:
        assert isinstance(device, tuple) and device[0] >= 3
