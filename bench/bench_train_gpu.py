"""GPU training bench (issues 12, 23): step time, trained positions/s, peak memory and the fraction of the
FLOP bound of one training micro-batch at the Qwen3-8B drafter shapes (hidden 4096, vocab 151936,
T=4096, 512 anchors, B=16; 1 and 5 layers) for split, compiled flex and dense attention, plus the
`dflash-train train` throughput with the SmolLM2 target (recipes/smollm2-135m-gpu.yaml).

A step is what the trainer runs per micro-batch: `microbatch_loss` forward and backward, bf16 on the
GPU, the LM-head chunk of `logits_chunk: auto`, then the toolkit's optimizer step (train/optimizer.py:
fused AdamW, gradient clip on the device). FLOPs are counted from the shapes (the LM head forward and
input gradient; per layer the q/k/v/o and MLP matmuls forward and backward, the context k/v
projections, the query-key pairs the training mask allows; the context projection); the bound is
those FLOPs at the rate of a plain square matmul in the step's dtype, measured in the same run.

Variants (`--list`): split-1, flex-1, dense-1, split-5, flex-5, dense-5, flex-ckpt-5 (flex with
activation checkpointing); flex-1-eager and flex-5-eager (the LM head's epilogue and the layers'
RMSNorm / SwiGLU / RoPE eager, as before issue 23's item 8), flex-5-eager-head and flex-5-eager-layers
(one of the two eager): the baselines of the compiled parts (`objective.head`, `objective.layer_kernels`),
which every other variant runs on a GPU; train, train-v8k (the same run with a trained head of 8,192 ids
instead of the target's frozen 49,152) and train-all-slots (every slot of a block trained, not the recipe's
1-7). Each runs in its own subprocess (its own peak memory) under `--timeout`; every finished variant appends
one JSON line to `--json` at once, and a failed one (out of memory, a compile error, a timeout) is a row with its
error while the run goes on (bench/variants.py).
On the GPU machine run one or two variants per command (each fits its 10-minute limit).

`--smoke` runs the same code on CPU at a tiny shape in fp32 (compiled flex is a row "n/a": torch has no
CPU flex-attention backward), CI-safe, in about a minute; without a CUDA GPU the bench runs the smoke.

`--profile N` runs N more steps of each variant under torch.profiler (dflash_train/train/profiling.py): the
share of the time the device is busy, milliseconds per kernel class and the heaviest kernels. For `train`
they are N more steps of the same `dflash-train train` run (`logging.profile_steps`), after the timed ones.

Usage: python bench/bench_train_gpu.py [--smoke] [--variant NAME ...] [--list] [--steps 10]
       [--train-steps 60] [--json FILE] [--timeout 540] [--profile N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_step import Shape, build_step  # noqa: E402 - the sibling benches, shared
from variants import add_arguments, answered, commit, error_of, run_all, run_child  # noqa: E402

from dflash_train.train.profiling import profile_lines  # noqa: E402

QWEN3_8B = Shape(hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936,
                 target_hidden=4096, features=5, tokens=4096, anchors=512, block=16)
TINY = Shape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=1024, target_hidden=64,
             features=5, tokens=384, anchors=48, block=16)
# name: (layers, attention, activation checkpointing, LM head epilogue, layer ops); `train` is the train row
STEP_VARIANTS = {f"{a}-{n}": (n, a, False, "auto", "auto") for n in (1, 5) for a in ("split", "flex", "dense")}
STEP_VARIANTS["flex-ckpt-5"] = (5, "flex", True, "auto", "auto")
# the compiled parts eager (issue 23 item 8), the baselines of the compiled head and layer ops in the same run
STEP_VARIANTS.update({f"flex-{n}-eager": (n, "flex", False, "eager", "eager") for n in (1, 5)})
STEP_VARIANTS["flex-5-eager-head"] = (5, "flex", False, "eager", "auto")
STEP_VARIANTS["flex-5-eager-layers"] = (5, "flex", False, "auto", "eager")


def _label(attention: str, checkpointing: bool, head: str, layer_ops: str) -> str:
    eager = [part for part, kind in (("head", head), ("layer ops", layer_ops)) if kind == "eager"]
    return (attention + (" + checkpointing" if checkpointing else "")
            + (f", {' and '.join(eager)} eager" if eager else ""))


def _about(layers: int, attention: str, checkpointing: bool, head: str, layer_ops: str) -> str:
    return (f"{layers} layer(s), {_label(attention + ' attention', checkpointing, head, layer_ops)}, "
            "Qwen3-8B drafter shapes (CPU smoke: tiny)")


# the `dflash-train train` rows: the recipe's overrides of each. train-v8k: the kind of head the CPU demo trains, the
# 8,192 most frequent ids of the rows, trained, instead of the target's frozen 49,152-row head; at B=16 on the CPU
# demo's rows a reduced trained head replays level with the full one or above it (docs/results, round 34), and on the
# H200 the full head's epilogue alone was 10.6 ms of the recipe's 85.7 ms step (3259f27): the ratio of the two rows
# train-all-slots: every slot of a block trained (objective.trained_slots null) instead of the recipe's 1..7: the
# ratio of the two rows is what the recipe's cut saves a GPU step (the head and the last layer's MLP over 7 of 15 slots)
TRAIN_VARIANTS = {"train": {}, "train-v8k": {"drafter.draft_vocab_size": 8192, "drafter.train_lm_head": True},
                  "train-all-slots": {"objective.trained_slots": "null"}}
VARIANTS = {**{k: _about(*v) for k, v in STEP_VARIANTS.items()},
            "train": "dflash-train train on recipes/smollm2-135m-gpu.yaml: tokens/s (CPU smoke: 4 tiny steps)",
            "train-v8k": "the same with a reduced head of 8,192 ids, trained (what the full frozen head costs)",
            "train-all-slots": "the same with every slot of a block trained (what objective.trained_slots saves)"}
ROOT = Path(__file__).resolve().parents[1]


def step_flops(shape: Shape, mb) -> float:
    """Useful FLOPs of one micro-batch, forward and backward (recomputation not counted)."""
    s = shape
    n, b = mb.labels.shape
    rows, t, labelled = n * b, mb.packed.input_ids.numel(), int(mb.valid.sum())
    visible = int((mb.anchors - mb.layout.doc_start).sum())  # context keys per block, summed
    pairs = b * visible + n * b * b  # each block's queries x (its context, its own block)
    kv = 2 * s.kv_heads * s.head_dim
    fc = 2 * 2 * t * s.features * s.target_hidden * s.hidden  # forward + weight gradient (features are data)
    layer = (3 * 2 * t * s.hidden * kv  # context k/v: forward, input and weight gradients
             + 3 * 2 * rows * s.hidden * (2 * s.heads * s.head_dim + kv)  # q, o and block k/v
             + 3 * 2 * rows * s.hidden * 3 * s.intermediate  # gate, up, down
             + 3 * 4 * pairs * s.heads * s.head_dim)  # scores and values, forward + 2x backward
    head = 2 * 2 * labelled * s.hidden * s.vocab  # logits and the input gradient (the head is frozen)
    return fc + s.layers * layer + head


def matmul_rate(device: str, dtype, n: int) -> float:
    """FLOP/s of an n^3 matmul in `dtype` on `device` (best of 5 after a warm-up)."""
    import torch

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(6):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(shape: Shape, attention: str, checkpointing: bool, steps: int, device: str,
                head: str = "auto", layer_ops: str = "auto", profile: int = 0) -> dict:
    import torch

    from dflash_train import compiled
    from dflash_train.train.batches import head_rows, microbatch_loss
    from dflash_train.train.device import resolve_head, resolve_layer_kernels
    from dflash_train.train.loss import auto_logits_chunk
    from dflash_train.train.optimizer import DeviceAdamW

    if device == "cpu":  # tiny shapes: with more threads than free cores, thread start-up dominates
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, mb = build_step(shape, device, dtype)
    model.activation_checkpointing = checkpointing
    chunk = auto_logits_chunk(head_rows(model), device)
    head = resolve_head(head, device)
    layer_ops = resolve_layer_kernels(layer_ops, device, 0)
    model.use_fused_ops(layer_ops == "compiled")
    weight = mb.weight_sum

    optimizer = DeviceAdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0, grad_clip=1.0,
                            fp32_masters=dtype != torch.float32)

    def step():  # the update is tiny (lr 1e-6): every step measures the same work
        loss, _ = microbatch_loss(model, mb, attention=attention, chunk=chunk, head=head)
        (loss / weight).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # warm-up: compiles, allocator pools
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()  # no per-step sync: steps queue back to back, as in training
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    row = {"step_s": step_s, "positions": int(mb.valid.sum()), "peak_bytes": peak, "flops": step_flops(shape, mb),
           "chunk": chunk, "head": head, "layer_ops": layer_ops, "fallbacks": dict(compiled.fallbacks)}
    if profile:  # after the timed steps: the profiler's own cost stays out of step_s
        from dflash_train.train.profiling import profile_steps

        row["profile"] = profile_steps(step, profile, device)
    return row


def train_throughput(smoke: bool, steps: int, profile: int = 0, overrides: dict | None = None) -> dict:
    """`dflash-train train` on the SmolLM2 GPU recipe (no regeneration: throughput only), with `overrides`
    (a TRAIN_VARIANTS entry): tokens/s between the first train log entry (the first window holds compile and
    warm-up) and the one at `steps`; then `profile` more steps under the profiler (the run's profile.json, as
    the row's `profile`)."""
    sets = {"data.regenerate.enabled": "false", "data.max_samples": 2000, "eval.enabled": "false",
            "logging.log_every": 10, "logging.eval_every": 10**6, "checkpoint.save_every": 10**6,
            "logging.progress": "false", **(overrides or {})}
    if smoke:  # CPU: a 1-layer fp32 drafter with a small head on a few short rows, features computed once
        steps = 4
        sets.update({"data.source": "chitchat", "data.max_samples": 12, "data.max_length": 96,
                     "data.features": "memory", "drafter.num_layers": 1, "drafter.draft_vocab_size": 2048,
                     "batch.tokens_per_microbatch": 256, "objective.anchors_per_document": 16,
                     "engine.precision": "fp32", "logging.log_every": 1})
    with tempfile.TemporaryDirectory() as tmp:
        sets["data.cache_dir"] = str(Path(tmp) / "data")
        cmd = [str(Path(sys.executable).parent / "dflash-train"), "train", "--config",
               str(ROOT / "recipes" / "smollm2-135m-gpu.yaml"), "--output", str(Path(tmp) / "run"),
               "--max-steps", str(steps + profile)]
        if profile:
            sets.update({"logging.profile_steps": profile, "logging.profile_from": steps})
        for key, value in sets.items():
            cmd += ["--set", f"{key}={value}"]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", **({"OMP_NUM_THREADS": "1"} if smoke else {})}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(f"dflash-train train failed: {error_of(out.stderr)}")
        state = sorted((Path(tmp) / "run" / "checkpoints").glob("step-*/trainer_state/state.json"))[-1]
        logs = [h for h in json.loads(state.read_text())["history"] if h["split"] == "train" and h["step"] <= steps]
        profiled = json.loads((Path(tmp) / "run" / "profile.json").read_text()) if profile else None
    first, last = logs[0], logs[-1]
    dt = last["time_s"] - first["time_s"]
    return {"tokens_per_s": (last["tokens"] - first["tokens"]) / dt, "step_s": dt / (last["step"] - first["step"]),
            "steps": last["step"] - first["step"], "layers": int(sets.get("drafter.num_layers", 3)),
            "tokens_per_microbatch": int(sets.get("batch.tokens_per_microbatch", 8192)),
            "draft_vocab": sets.get("drafter.draft_vocab_size"),  # None: the target's whole vocabulary
            "head": "trained" if sets.get("drafter.train_lm_head") else "frozen",
            "features": sets.get("data.features", _recipe_value("data", "features")),
            "trained_slots": str(sets.get("objective.trained_slots", _recipe_value("objective", "trained_slots"))),
            **({"profile": profiled} if profiled else {})}


def _recipe_value(section: str, key: str) -> str:
    import yaml

    return str(yaml.safe_load((ROOT / "recipes" / "smollm2-135m-gpu.yaml").read_text())[section].get(key))


def _step_row(r: dict, rate: float) -> str:
    layers, attention = r["layers"], r["attention"]
    name = f"{layers} layer{'s' if layers > 1 else ''}"
    if "error" in r:
        return f"| {name} | {attention} | {r['error']} | | | | |"
    bound_s = r["flops"] / rate
    return (f"| {name} | {attention} | {r['step_s'] * 1e3:.1f} | {r['positions'] / r['step_s']:,.0f} | "
            f"{r['peak_bytes'] / 2**30:.2f} | {r['flops'] / 1e12:.3g} T ({bound_s * 1e3:.1f} ms) | "
            f"{bound_s / r['step_s']:.0%} |")


def _train_line(t: dict) -> str:
    if "error" in t:
        return f"`dflash-train train`: {t['error']}"
    head = f"a {t['head']} head of {t['draft_vocab']:,} ids" if t["draft_vocab"] else "the target's head, frozen"
    slots = "every slot" if t.get("trained_slots", "None") in ("None", "null") else f"slots 1-{t['trained_slots']}"
    return (f"`dflash-train train`, SmolLM2-135M target ({t['features']} features), {t['layers']} draft layer(s), "
            f"B=16 ({slots} trained), {t['tokens_per_microbatch']}-token micro-batches, {head}, "
            f"attention auto: {t['tokens_per_s']:,.0f} "
            f"tokens/s ({t['step_s']:.3f} s/step over {t['steps']} steps)")


def _child(spec: dict) -> dict:
    if spec["kind"] == "train":
        return train_throughput(spec["smoke"], spec["steps"], spec.get("profile", 0),
                                TRAIN_VARIANTS[spec.get("variant", "train")])
    return run_variant(Shape(**spec["shape"]), spec["attention"], spec["checkpointing"], spec["steps"],
                       spec["device"], spec.get("head", "auto"), spec.get("layer_ops", "auto"), spec.get("profile", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, fp32 (what CI runs)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--train-steps", type=int, default=60, help="optimizer steps of the dflash-train train row")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed steps, N more under torch.profiler: device busy share, ms per kernel class")
    add_arguments(ap, list(VARIANTS))
    args = ap.parse_args()
    if answered(args, VARIANTS, _child):
        return
    import torch

    smoke = args.smoke or not torch.cuda.is_available()
    if smoke and not args.smoke:
        print("no CUDA GPU here: running the CPU smoke (--smoke)")
    device, base = ("cpu", TINY) if smoke else ("cuda", QWEN3_8B)
    steps = min(args.steps, 2) if smoke else args.steps
    if smoke:
        torch.set_num_threads(1)  # as the variants
    rate = matmul_rate(device, torch.float32 if smoke else torch.bfloat16, 512 if smoke else 8192)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; {'fp32' if smoke else 'bf16'} matmul rate {rate / 1e12:.3g} TFLOP/s "
          f"(the bound); shape: hidden {base.hidden}, vocab {base.vocab}, T={base.tokens}, {base.anchors} anchors, "
          f"B={base.block}; {steps} timed steps per variant\n")
    context = {"bench": "bench_train_gpu", "device": name, "torch": torch.__version__, "commit": commit(),
               "smoke": smoke, "matmul_flops_per_s": rate}

    def run_one(variant: str) -> dict:
        if variant in TRAIN_VARIANTS:
            return run_child(__file__, {"kind": "train", "variant": variant, "smoke": smoke,
                                        "steps": args.train_steps, "profile": args.profile}, args.timeout)
        layers, attention, checkpointing, head, layer_ops = STEP_VARIANTS[variant]
        label = {"layers": layers, "attention": _label(attention, checkpointing, head, layer_ops)}
        if attention == "flex" and device == "cpu":
            return {**label, "error": "n/a on CPU (no flex backward)"}
        spec = {"kind": "step", "shape": asdict(replace(base, layers=layers)), "attention": attention,
                "checkpointing": checkpointing, "steps": steps, "device": device, "head": head,
                "layer_ops": layer_ops, "profile": args.profile}
        return {**label, **run_child(__file__, spec, args.timeout)}

    header = False

    def show(variant: str, row: dict) -> None:
        nonlocal header
        if variant in TRAIN_VARIANTS:
            print("\n" + _train_line(row), flush=True)
            if "profile" in row:
                print("\n".join(profile_lines(row["profile"])), flush=True)
            return
        if not header:
            print("| drafter | attention | step ms | positions/s | peak GiB | FLOP (bound) | of bound |")
            print("|---|---|---|---|---|---|---|")
            header = True
        print(_step_row(row, rate), flush=True)
        if "profile" in row:
            print("\n".join(profile_lines(row["profile"])), flush=True)

    rows = run_all(args.variant or list(VARIANTS), run_one, args.json, context, show)
    failed = [r["variant"] for r in rows if "error" in r and not r["error"].startswith("n/a")]
    if failed:
        print(f"\nfailed: {', '.join(failed)} (each is a row with its error{' in ' + args.json if args.json else ''})")
        sys.exit(1)


if __name__ == "__main__":
    main()
