"""Where a training step's time goes: a few steps under `torch.profiler`, summarised from its trace.

The summary of a Chrome trace: the share of the profiled wall time in which the device ran a kernel (the
union of the kernel intervals; the rest is the device waiting for the host), the time per kernel class
per step (matmul, attention, compiled / triton, elementwise and reductions, copies, optimizer, other) and
the heaviest kernels by name. On a CPU the events read are the top-level CPU operators.

- `StepProfile`: `logging.profile_steps` steps of a `dflash-train train` run, from `logging.profile_from`
  steps after it (re)starts (past the compiles); writes `OUT/profile.json` (the summary) and
  `OUT/profile_trace.json` (the trace, for Perfetto or chrome://tracing).
- `profile_steps(step, steps, device)`: the benches' form, `step()` called `steps` times.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

# first match wins: the order matters (a triton flex kernel is attention; a fused triton kernel
# that casts is compiled, not a copy)
KERNEL_CLASSES = (
    ("attention", re.compile(r"flex|attention|fmha|flash|sdpa", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("matmul", re.compile(r"gemm|matmul|nvjet|cutlass|sm\d+_xmma|cublas|\bmm\b|addmm|bmm", re.I)),
    ("compiled", re.compile(r"^triton", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|cat|transpose|contiguous", re.I)),
    ("elementwise/reduce", re.compile(r"elementwise|vectorized|reduce|softmax|norm|unrolled", re.I)),
)


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "other"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + (e - s), e
        elif e > end:
            total, end = total + (e - end), e
    return total


def summarise_trace(trace: dict, steps: int, category: str, wall_us: float | None = None, top: int = 12) -> dict:
    """The summary of a Chrome trace's `category` events ("kernel" on CUDA, "cpu_op" on CPU)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") == category and e.get("ph") == "X"]
    if not events:
        return {"error": f"no '{category}' events in the profiler trace"}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events]
    busy = busy_us(spans)
    wall = wall_us or (max(e for _, e in spans) - min(s for s, _ in spans))
    per_class: dict[str, float] = {}
    per_name: dict[str, float] = {}
    for e in events:
        dur, label = float(e.get("dur", 0)), kernel_class(e["name"])
        per_class[label] = per_class.get(label, 0.0) + dur
        per_name[e["name"]] = per_name.get(e["name"], 0.0) + dur
    heaviest = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {"profiled_steps": steps, "device_busy": round(min(busy / wall, 1.0), 4) if wall > 0 else None,
            "wall_ms_per_step": round(wall / steps / 1e3, 3),
            "kernel_ms_per_step": {k: round(v / steps / 1e3, 3) for k, v in sorted(per_class.items(), key=lambda kv: -kv[1])},
            "kernels_per_step": round(len(events) / steps, 1),
            "top_kernels": [[name[:120], round(us / steps / 1e3, 3)] for name, us in heaviest]}


def profile_steps(step, steps: int, device: str) -> dict:
    """Run `step()` `steps` times under the profiler and summarise the trace (see the module doc): a
    `StepProfile` over a loop of its own, its files in a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        window = StepProfile(steps, 0, steps, device, Path(tmp))
        for i in range(steps):
            window.begin(i)
            step()
            window.end(i)
    return {k: v for k, v in window.summary.items() if k not in ("first_step", "steps", "trace")}


def profile_lines(summary: dict) -> list[str]:
    """A few printable lines of a summary."""
    if "error" in summary:
        return [f"profile: {summary['error']}"]
    classes = ", ".join(f"{k} {v:.1f}" for k, v in summary["kernel_ms_per_step"].items())
    busy = summary["device_busy"]
    lines = [f"profile ({summary['profiled_steps']} steps): device busy {busy:.0%} of "
             f"{summary['wall_ms_per_step']:.1f} ms/step, {summary['kernels_per_step']:.0f} kernels/step; "
             f"ms/step by class: {classes}"]
    lines += [f"    {ms:8.3f} ms  {name}" for name, ms in summary["top_kernels"]]
    return lines


class StepProfile:
    """Profile the steps [first, first + steps) of a training loop: `begin(step)` before a step runs, `end(step)`
    after it. The window is cut to the steps the run has left; only the main rank writes. Device work is
    synchronised at the window's two edges only, so the steps inside queue as they do unprofiled."""

    def __init__(self, steps: int, first: int, last: int, device, output: Path | None):
        self.first = min(first, max(0, last - steps))
        self.stop = min(self.first + steps, last)
        self.device, self.output = str(getattr(device, "type", device)), output
        self.prof, self.t0, self.summary = None, 0.0, None
        if steps <= 0:
            self.first = self.stop = -1

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def begin(self, step: int) -> None:
        if step != self.first or self.output is None:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self._sync()
        # the operands' shapes in the trace: a matmul slow at one shape and not another (oneDNN compiling a kernel
        # for each new CPU bf16 shape, model/row_buckets.py) shows only with them
        self.prof = profile(activities=activities, record_shapes=True)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def end(self, step: int) -> dict | None:
        """The summary once the window's last step is done (also in `self.summary`), else None."""
        if self.prof is None or step + 1 != self.stop:
            return None
        self._sync()
        wall_us = (time.perf_counter() - self.t0) * 1e6
        self.prof.__exit__(None, None, None)
        trace_path = self.output / "profile_trace.json"
        tmp = trace_path.with_name(f".{trace_path.name}.tmp")
        self.prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace_path)
        self.prof = None
        steps = self.stop - self.first
        summary = summarise_trace(json.loads(trace_path.read_text()), steps,
                                  "kernel" if self.device == "cuda" else "cpu_op", wall_us)
        self.summary = {"first_step": self.first, "steps": steps, **summary, "trace": trace_path.name}
        from dflash_train.model.weights import write_json

        write_json(self.output / "profile.json", self.summary)
        return self.summary
