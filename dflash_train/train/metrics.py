"""Run records: TensorBoard scalars, a progress bar, the curves PNG and summary.json."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from dflash_train.model.weights import write_json
from dflash_train.outputs import png_software
from dflash_train.peak_memory import high_water


class GradNormWindow:
    """The global gradient norm over a logging window, from the optimizer's own clip (DeviceAdamW and DeviceMuon
    compute it on the device each step): its mean, its largest value and the share of steps the clip scaled down,
    summed on the device and read when the window is logged (`train/grad_norm`, `train/grad_norm_max`,
    `train/clipped`). Empty where the optimizer computes no norm (no clip, DeepSpeed's own optimizers)."""

    def __init__(self, optimizer, clip: float, device):
        import torch

        self.optimizer = optimizer if getattr(optimizer, "computes_grad_norm", False) else None
        self.clip = float(clip)
        self._total, self._clipped, self._top = (torch.zeros((), device=device) for _ in range(3))
        self._steps = 0

    def add(self) -> None:
        import torch

        norm = self.optimizer.grad_norm if self.optimizer is not None else None
        if norm is None:
            return
        norm = norm.detach().float().reshape(())
        self._total += norm
        self._clipped += norm > self.clip
        torch.maximum(self._top, norm, out=self._top)
        self._steps += 1

    def read(self) -> dict:
        """{} or {grad_norm, grad_norm_max, clipped} over the steps since the last read; starts a new window."""
        if not self._steps:
            return {}
        out = {"grad_norm": float(self._total) / self._steps, "grad_norm_max": float(self._top),
               "clipped": float(self._clipped) / self._steps}
        for t in (self._total, self._clipped, self._top):
            t.zero_()
        self._steps = 0
        return out


class RunLog:
    """Metric history (kept in checkpoints so a resumed run continues its curves) and TB logging."""

    def __init__(self, output: Path, enabled: bool, history: list[dict] | None = None):
        self.output = Path(output)
        self.enabled = enabled
        self.history: list[dict] = list(history or [])
        self._tb = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.output / "tensorboard"))

    def record(self, step: int, split: str, stats: dict, extra: dict | None = None) -> None:
        entry = {"step": step, "split": split, **stats, **(extra or {})}
        self.history.append(entry)
        if self._tb is None:
            return
        self._tb.add_scalar(f"{split}/loss", stats["loss"], step)
        self._tb.add_scalar(f"{split}/accept_len", stats["accept_len"], step)
        if split == "train" and "accept_len_per_block" in stats:  # the check's blocks are one per position
            self._tb.add_scalar(f"{split}/accept_len_per_block", stats["accept_len_per_block"], step)
        for k, a in enumerate(stats["acc"], start=1):
            self._tb.add_scalar(f"{split}/acc_pos{k}", a, step)
        for key, value in (extra or {}).items():
            if isinstance(value, (int, float)):
                self._tb.add_scalar(f"{split}/{key}", value, step)

    def last(self, split: str) -> dict | None:
        for entry in reversed(self.history):
            if entry["split"] == split:
                return entry
        return None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


class Progress:
    """tqdm bar over optimizer steps; loss, acceptance, trained positions/s and lr are refreshed at log
    time (reading them every step would make every step wait for the GPU)."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.bar = None
        self.t0 = time.time()
        self.start = start
        self.positions0: int | None = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def note(self, lines: list[str]) -> None:
        """Print lines above the bar (or plainly without one)."""
        for line in lines:
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)

    def show(self, stats: dict, lr: float, positions: int, fit: dict | None = None, val: dict | None = None) -> None:
        """stats: a BlockStats summary; positions: trained positions of the run so far; fit, val: the last
        check's entries (a block at every position of training and of held-out rows), shown beside the
        step's own `tau` (its sampled blocks), which reads above them (docs/training.md, "Reading the metrics")."""
        if self.positions0 is None:  # the rate counts this session's positions only (resumed runs)
            self.positions0 = positions - stats["positions"]
        if self.bar is None:
            return
        rate = (positions - self.positions0) / max(1e-9, time.time() - self.t0)
        checks = {name: f"{entry['accept_len']:.2f}" for name, entry in (("fit", fit), ("val", val)) if entry}
        self.bar.set_postfix({"loss": f"{stats['loss']:.3f}", "tau": f"{stats['accept_len']:.2f}", **checks,
                              "lr": f"{lr:.2e}", "pos_s": f"{rate:.0f}"}, refresh=True)  # in this order

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_curves(history: list[dict], path: Path) -> None:
    """Loss and acceptance curves (the steps' own, the check's on training rows and on held-out rows) and the
    last per-position accuracy, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for split, style in (("train", "-"), ("fit", "s--"), ("val", "o-")):
        rows = [h for h in history if h["split"] == split]
        if not rows:
            continue
        steps = [h["step"] for h in rows]
        axes[0].plot(steps, [h["loss"] for h in rows], style, label=split)
        axes[1].plot(steps, [h["accept_len"] for h in rows], style, label=split)
        if split == "train" and all("accept_len_per_block" in h for h in rows):
            axes[1].plot(steps, [h["accept_len_per_block"] for h in rows], ":", color="grey",
                         label="train, per sampled block")
        last = rows[-1]["acc"]
        axes[2].plot(range(1, len(last) + 1), last, style, label=f"{split} (step {rows[-1]['step']})")
    axes[0].set(title="loss", xlabel="step")
    axes[1].set(title="acceptance length (per position)", xlabel="step")
    axes[2].set(title="accuracy per position", xlabel="slot k", ylim=(0, 1))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100, metadata={"Software": png_software("train")})
    plt.close(fig)
    tmp.replace(path)


def write_summary(path: Path, summary: dict) -> None:
    write_json(path, summary)


class Laps:
    """Where a run's time goes, stage by stage (summary.json `stage_seconds`): `lap(name)` adds the seconds since
    the last lap to `name`; `with lap.aside(name):` counts a block under `name` instead of the lap it sits in
    (the checks and checkpoints inside the steps; on a GPU such a block's first device read also waits for the
    steps still queued, ~a step's time); `final()` closes the last lap. `clock`: seconds that never go back (a
    wall clock set back mid-run would make a lap negative). `memory`: the process's resident high-water mark, and
    its finished children's, as each lap closed (summary.json `memory_high_water_gib`): the lap where it grew is
    the one that raised the run's peak."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds, self.asides, self.last = {}, {}, clock()
        self.memory: dict[str, dict] = {}

    def __call__(self, name: str) -> None:
        now = self.clock()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self.last, 2)
        self.last = now
        self.memory[name] = high_water()

    @contextmanager
    def aside(self, name: str):
        t0 = self.clock()
        try:
            yield
        finally:
            took = self.clock() - t0
            self.asides[name] = round(self.asides.get(name, 0.0) + took, 2)
            self.last += took

    def final(self) -> dict:
        self.memory["final"] = high_water()
        return {**self.seconds, **self.asides, "final": round(self.clock() - self.last, 2)}
