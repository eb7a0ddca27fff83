"""dflash_train/train/profiling.py: the busy share is the union of kernel intervals, a real profiler trace of a
CPU step is read back into classes whose times add up, and a training loop's window of steps is profiled into
OUT/profile.json and its trace."""

import json
import random

import pytest
import torch

from dflash_train.train.profiling import (
    StepProfile,
    busy_us,
    kernel_class,
    profile_lines,
    profile_steps,
    summarise_trace,
)


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


def test_a_loop_window_is_profiled_into_its_files_and_cut_to_the_run(tmp_path):
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    ran = []
    profile = StepProfile(3, 5, 12, torch.device("cpu"), tmp_path)
    for step in range(0, 12):
        profile.begin(step)
        (a @ b).relu_().sum()
        ran.append((step, profile.prof is not None))
        summary = profile.end(step)
        assert (summary is not None) == (step == 7)
    assert [s for s, inside in ran if inside] == [5, 6, 7]
    written = json.loads((tmp_path / "profile.json").read_text())
    assert written == profile.summary and written["first_step"] == 5 and written["steps"] == 3
    assert written["profiled_steps"] == 3 and written["kernel_ms_per_step"]["matmul"] > 0
    trace = json.loads((tmp_path / written["trace"]).read_text())  # the trace itself, for Perfetto
    assert sum(e.get("name") == "aten::mm" for e in trace["traceEvents"]) == 3
    assert not list(tmp_path.glob(".*tmp"))  # written by rename
    # a run resumed near its end profiles its last steps; a short one all of them; 0 steps or a rank that
    # does not write: nothing
    assert (StepProfile(3, 30, 20, "cpu", tmp_path).first, StepProfile(3, 30, 20, "cpu", tmp_path).stop) == (17, 20)
    assert (StepProfile(5, 20, 2, "cpu", tmp_path).first, StepProfile(5, 20, 2, "cpu", tmp_path).stop) == (0, 2)
    off = StepProfile(0, 0, 10, "cpu", tmp_path)
    other_rank = StepProfile(2, 0, 10, "cpu", None)
    for step in range(10):
        for p in (off, other_rank):
            p.begin(step)
            assert p.prof is None and p.end(step) is None
