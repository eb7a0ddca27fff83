"""DeepSpeed runs on the trainer's device whatever other GPU torch reports (engine.pin_deepspeed_accelerator).

DeepSpeed chooses its accelerator itself and takes an Apple GPU before the CPU; its engine then moves the drafter
there while the batches stay on the CPU, and every `make demo` on an Apple-silicon Mac failed in its first step.
An Apple GPU cannot be had here: the subprocesses below make `torch.mps.current_allocated_memory()` return, as
it does on a Mac, which is the whole of DeepSpeed's probe for one. Each test first checks that DeepSpeed,
left alone, really takes `mps` under that probe."""

import os
import subprocess
import sys

import pytest

# what a Mac's torch answers DeepSpeed's probe with (elsewhere the call raises: no MPS backend)
APPLE_GPU_PROBE = "import torch.mps\ntorch.mps.current_allocated_memory = lambda: 0\n"

# DeepSpeed's own pick under the probe, then one real DeepSpeed step through the trainer's engine
STEP = """
import sys, torch
if sys.argv[1] == "imported-first":
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    print("deepspeed alone:", get_accelerator().device_name())
from dflash_train.train.engine import build_engine, init_distributed
from dflash_train.train.recipe import TrainRecipe

world = init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
recipe = TrainRecipe.model_validate({"data": {"prepared": "rows"}, "engine": {"precision": "fp32"}})
engine, _ = build_engine(model, recipe, total_steps=4)
before = [p.detach().clone() for p in engine.module.parameters()]
loss = engine(torch.randn(4, 8)).square().mean()
engine.backward(loss)
engine.step()
moved = max((p.detach() - b).abs().max().item() for p, b in zip(engine.module.parameters(), before))
print("world:", world.device.type, "engine:", engine.device, "weights:",
      sorted({p.device.type for p in engine.module.parameters()}), "moved:", moved > 0)
"""


def _run(tmp_path, *args, env_extra=None):
    (tmp_path / "sitecustomize.py").write_text(APPLE_GPU_PROBE)
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "DFLASH_DS_ACCELERATOR")}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]), PYTHONWARNINGS="ignore",
               CUDA_VISIBLE_DEVICES="", **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", STEP, *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)


def test_deepspeed_takes_the_apple_gpu_when_left_to_choose(tmp_path):
    out = _run(tmp_path, "imported-first")
    assert "deepspeed alone: mps" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("order", ["imported-first", "trainer-first"])
def test_the_engine_trains_on_the_cpu_beside_an_apple_gpu(tmp_path, order):
    """Whether DeepSpeed was imported (and chose) before the trainer started or not, the engine's weights stay on
    the trainer's device and a step moves them."""
    out = _run(tmp_path, order)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world: cpu engine: cpu weights: ['cpu'] moved: True" in out.stdout, out.stdout


def test_ds_accelerator_set_to_the_trainers_device_is_kept(tmp_path):
    out = _run(tmp_path, "trainer-first", env_extra={"DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine: cpu" in out.stdout


def test_ds_accelerator_set_to_another_device_is_refused_by_name(tmp_path):
    out = _run(tmp_path, "trainer-first", env_extra={"DS_ACCELERATOR": "mps"})
    assert out.returncode != 0
    assert "DS_ACCELERATOR=mps: dflash-train trains on cpu here" in out.stderr, out.stderr[-3000:]
    assert "unset DS_ACCELERATOR or set DS_ACCELERATOR=cpu" in out.stderr


def test_a_parent_dflash_trains_pin_is_not_taken_for_the_users(tmp_path):
    """A CUDA run pins DS_ACCELERATOR=cuda and its children inherit it; one started with the GPU hidden trains on
    the CPU instead of refusing the pin as a user's setting."""
    out = _run(tmp_path, "trainer-first", env_extra={"DS_ACCELERATOR": "cuda", "DFLASH_DS_ACCELERATOR": "cuda"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world: cpu engine: cpu weights: ['cpu'] moved: True" in out.stdout, out.stdout
