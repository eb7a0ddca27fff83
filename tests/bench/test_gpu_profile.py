"""bench/gpu_profile.py: the busy share is the union of kernel intervals, and a real profiler trace of a
CPU step is read back into classes whose times add up."""

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gpu_profile import busy_us, kernel_class, profile_lines, profile_steps, summarise_trace  # noqa: E402


def test_busy_time_is_the_union_of_overlapping_intervals():
    rng = random.Random(0)
    intervals = [(s, s + rng.randint(1, 30)) for s in (rng.randint(0, 500) for _ in range(60))]
    covered = {t for s, e in intervals for t in range(s, e)}  # unit slots, brute force
    assert busy_us(intervals) == pytest.approx(len(covered))
    assert busy_us([(0, 10), (2, 5), (20, 25)]) == 15


@pytest.mark.parametrize("name,label", [
    ("triton_tem_fused_flex_attention_0", "attention"), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"), ("void at::native::(anonymous)::multi_tensor_apply_kernel", "optimizer"),
    ("triton_red_fused__to_copy_mul_sum_3", "compiled"), ("Memcpy DtoD (Device -> Device)", "copy"), ("triton_poi_fused_add_rsqrt_5", "compiled"),
    ("void at::native::vectorized_elementwise_kernel<4>", "elementwise/reduce"), ("mystery", "other")])
def test_kernel_names_fall_in_their_class(name, label):
    assert kernel_class(name) == label


def test_a_real_trace_is_summarised_per_step():
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step():
        (a @ b).relu_().sum()

    summary = profile_steps(step, 3, "cpu")
    assert summary["profiled_steps"] == 3
    assert 0 < summary["device_busy"] <= 1
    assert "matmul" in summary["kernel_ms_per_step"] and summary["kernel_ms_per_step"]["matmul"] > 0
    assert any("mm" in name for name, _ in summary["top_kernels"])
    assert "device busy" in profile_lines(summary)[0]


def test_a_trace_without_the_category_says_so():
    assert "no 'kernel' events" in summarise_trace({"traceEvents": [{"cat": "cpu_op", "ph": "X"}]}, 1, "kernel")["error"]
