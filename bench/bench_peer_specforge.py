"""The peer trainer on our data: SpecForge's DFlash model and loss trained on exactly the rows, features,
micro-batches, anchors per document, optimizer, schedule and steps of one of our runs.

Issue 31 asks for a lead over the best peer trainer at equal data and steps. This script holds
everything but the trainer fixed: it reads a finished run folder of ours (its resolved recipe, its
prepared rows and held-out split, its offline feature cache, its step plan: the same documents in the
same micro-batches at every step) and trains SpecForge's `OnlineDFlashModel` (its draft model, its
anchor sampler, its loss over the target's frozen full-vocabulary head and embedding) on them, with the
recipe's AdamW, warm-up, cosine schedule and gradient clip, in fp32 on the CPU (AdamW for every weight also where the
recipe gives some matrices Muon, `optim.algorithm: muon`: SpecForge's trainer steps with AdamW). What differs is what a
user changes by changing trainer: the optimizer, the objective (CE on the dataset's tokens with SpecForge's `loss_type`, against the
recipe's KL teacher with prefix weighting), the head (the target's, frozen, against a trained 4K head),
the anchor sampler and the initialisation.

The trained drafter is written as a z-lab folder (the config our converter writes for the run's
architecture, SpecForge's weights in the recipe's dtype), converted to a speculators folder by
`dflash-convert to-speculators`, and measured with the same commands as ours:

    dflash-train replay --draft OUT/drafter --rows RUN --json OUT/replay.json
    dflash-train eval --draft OUT/drafter --prompts RUN --num-prompts 24 --max-new-tokens 64 --no-speedup

SpecForge is imported, not copied: `pip install --no-deps --target DIR specforge==0.2.0` and pass
`--specforge DIR` (`make peer-specforge` does both). Its DFlash modules need only torch and
transformers. An interrupted run resumes from OUT/state.pt (written every --save-every steps).

Usage: python bench/bench_peer_specforge.py --run runs/demo/run --output runs/peer-sf [--loss dflash]
           [--gamma auto|none|G] [--steps N] [--specforge DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def padded(docs, device):
    """Documents as SpecForge's batch: input_ids [n, L], hidden states [n, L, F], loss mask [n, L] (0 on pads)."""
    import torch

    n, width = len(docs), max(len(d) for d in docs)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width)
    hidden = torch.zeros(n, width, docs[0].features.shape[-1])
    for i, d in enumerate(docs):
        t = len(d)
        ids[i, :t], mask[i, :t], hidden[i, :t] = d.input_ids, d.loss_mask.float(), d.features.float()
    return ids.to(device), hidden.to(device), mask.to(device)


def zlab_config(drafter) -> dict:
    """The z-lab config of the run's drafter architecture with the target's full vocabulary (SpecForge's head)."""
    from dflash_train.model.formats import zlab

    cfg = drafter.config
    return zlab.to_config_dict(cfg.model_copy(update={"draft_vocab_size": cfg.vocab_size}))


def write_zlab(folder: Path, config: dict, draft_model, dtype: str) -> None:
    """config.json + model.safetensors, written beside and renamed into place."""
    import torch

    from dflash_train.model.weights import write_json, write_tensors

    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    write_tensors(tmp, {k: v.to(getattr(torch, dtype)) for k, v in draft_model.state_dict().items()})
    write_json(tmp / "config.json", config)
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    tmp.rename(folder)


def gamma_arg(value: str, block_size: int) -> float | None:
    from dflash_train.train.anchors import gamma_for_block_size

    if value == "auto":
        return gamma_for_block_size(block_size)  # the DFlash paper's decay for this block size
    if value == "none":
        return None  # SpecForge's default: every slot weighs the same
    return float(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a finished `dflash-train train` folder (ours)")
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--specforge", type=Path, default=None, help="folder SpecForge was installed into (--target)")
    ap.add_argument("--loss", default="dflash", help="SpecForge's loss_type: dflash, dpace, ...")
    ap.add_argument("--gamma", default="auto", help="loss_decay_gamma: auto (the paper's for B), none, or a number")
    ap.add_argument("--steps", type=int, default=None, help="default: the run's own")
    ap.add_argument("--save-every", type=int, default=300)
    args = ap.parse_args()
    if args.specforge is not None:
        sys.path.insert(0, str(args.specforge))
    import torch
    from tqdm import tqdm

    try:
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel
    except ImportError as exc:
        raise SystemExit(f"--specforge {args.specforge}: cannot import SpecForge's DFlash modules ({exc}); install "
                         "them with `pip install --no-deps --target DIR specforge==0.2.0`") from None
    from transformers import Qwen3Config

    from dflash_train.model.weights import write_json
    from dflash_train.target import load_target, resolve_target, target_torch_dtype
    from dflash_train.train.build_drafter import build_drafter
    from dflash_train.train.documents import prepared_rows, source_balance, training_rows
    from dflash_train.train.engine import World, lr_lambda
    from dflash_train.train.feature_source import recipe_source
    from dflash_train.train.loop import StepPlan
    from dflash_train.train.optimizer import decay_groups
    from dflash_train.train.recipe import load_recipe

    resolved_yaml = args.run / "resolved_config.yaml"
    if not resolved_yaml.is_file():
        raise SystemExit(f"--run {args.run}: no resolved_config.yaml; give a `dflash-train train` output folder")
    recipe = load_recipe(resolved_yaml).recipe
    if recipe.data.features != "offline":
        raise SystemExit(f"--run {args.run}: data.features is {recipe.data.features}; this harness reads the "
                         "offline feature cache (the demo's)")
    device = torch.device("cpu")
    world = World(0, 1, 0, device)
    torch.manual_seed(recipe.seed)
    target_path = resolve_target(recipe.target)
    target, tokenizer = load_target(target_path, dtype=target_torch_dtype(recipe.data.target_dtype, device),
                                    device="cpu")
    data = training_rows(recipe.data, prepared_rows(recipe.data, target_path))
    if data.held != json.loads((args.run / "holdout_rows.json").read_text())["rows"]:
        raise SystemExit(f"--run {args.run}: its held-out rows differ from this data's split; rerun its train stage")
    o = recipe.objective
    if o.anchors_per_document is None:
        raise SystemExit(f"--run {args.run}: objective.anchor_density has no SpecForge equivalent; give a run with "
                         "objective.anchors_per_document (SpecForge's num_anchors)")
    # our drafter is built only for the draft vocabulary that names the run's feature cache (its top-k teacher)
    ours = build_drafter(recipe, target_path, target, tokenizer, data.token_counts, world)
    source = recipe_source(recipe, target_path, data, target, ours)
    plan = StepPlan(data.train, [source.lengths[i] for i in data.train], recipe, 1,
                    source_balance(data.train, data.labels))
    total = args.steps or plan.total

    config = zlab_config(ours)
    qconfig = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "auto_map")})
    qconfig._attn_implementation = "sdpa"
    torch.manual_seed(recipe.seed)
    for p in target.parameters():
        p.requires_grad_(False)
    gamma = gamma_arg(args.gamma, recipe.drafter.block_size)
    # the peer trains in fp32: its frozen head and embedding too (the target loads in bf16 where the CPU has bf16 dots)
    head, embed = copy.deepcopy(target.lm_head).float(), copy.deepcopy(target.get_input_embeddings()).float()
    model = OnlineDFlashModel(DFlashDraftModel(qconfig).float(), head, embed,
                              mask_token_id=recipe.drafter.mask_token_id, block_size=recipe.drafter.block_size,
                              attention_backend="sdpa", num_anchors=o.anchors_per_document,
                              loss_decay_gamma=gamma, loss_type=args.loss)
    params = [p for p in model.draft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(decay_groups(params, recipe.optim.weight_decay, recipe.optim.weight_decay_on),
                            lr=recipe.optim.lr, betas=tuple(recipe.optim.betas), weight_decay=recipe.optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, recipe.optim.warmup_ratio, recipe.optim.schedule,
                                                             recipe.optim.min_lr_ratio))
    args.output.mkdir(parents=True, exist_ok=True)
    state_path, log_path = args.output / "state.pt", args.output / "log.jsonl"
    meta = {"run": str(args.run), "loss": args.loss, "gamma": gamma, "steps": total, "block_size": qconfig.block_size,
            "anchors": o.anchors_per_document, "lr": recipe.optim.lr, "grad_clip": recipe.optim.grad_clip,
            "specforge": _specforge_version(args.specforge)}
    meta_path, drafter, start = args.output / "meta.json", args.output / "drafter", 0
    before = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if (state_path.is_file() or drafter.is_dir()) and before != meta:
        raise SystemExit(f"--output {args.output}: holds a run of other settings ({before}); give a new folder")
    if (drafter / "config.json").is_file():
        print(f"{drafter}: already trained with these settings", flush=True)
        return
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        model.draft_model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])
        start = state["step"]
        print(f"resumed at step {start} from {state_path}", flush=True)
    write_json(meta_path, meta)  # atomic: a killed run never leaves a half-written meta.json

    model.train()
    window, t0 = [], time.time()
    bar = tqdm(range(start, total), initial=start, total=total, desc="peer-specforge")
    for step in bar:
        loss = acc = 0.0
        for micro in range(recipe.batch.grad_accum):  # each micro-batch's mean, averaged over the step
            _, batch_rows = plan.rows_for(step, micro, 0, 1)
            ids, hidden, mask = padded(source.get(batch_rows), device)
            mb_loss, mb_acc, _ = model(input_ids=ids, hidden_states=hidden, loss_mask=mask)
            (mb_loss / recipe.batch.grad_accum).backward()
            loss += mb_loss.item() / recipe.batch.grad_accum
            acc += mb_acc.item() / recipe.batch.grad_accum
        torch.nn.utils.clip_grad_norm_(params, recipe.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        window.append((loss, acc))
        if (step + 1) % 50 == 0 or step + 1 == total:
            lo = sum(x for x, _ in window) / len(window)
            ac = sum(y for _, y in window) / len(window)
            window.clear()
            bar.set_postfix({"loss": f"{lo:.3f}", "acc": f"{ac:.3f}"})
            with log_path.open("a") as f:
                f.write(json.dumps({"step": step + 1, "loss": lo, "acc": ac, "lr": sched.get_last_lr()[0],
                                    "wall_s": round(time.time() - t0, 1)}) + "\n")
        if (step + 1) % args.save_every == 0 and step + 1 < total:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": model.draft_model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "rng": torch.get_rng_state(), "step": step + 1}, tmp)
            os.replace(tmp, state_path)
    bar.close()
    write_zlab(args.output / "zlab", config, model.draft_model, recipe.drafter.dtype)
    subprocess.run([str(Path(sys.executable).with_name("dflash-convert")), "to-speculators", str(args.output / "zlab"),
                    str(drafter), "--overwrite"], check=True)
    print(f"steps {start}..{total} in {time.time() - t0:.0f} s; drafter: {drafter}\nmeasure it:\n"
          f"  dflash-train replay --draft {drafter} --rows {args.run} --json {args.output / 'replay.json'}\n"
          f"  dflash-train eval --draft {drafter} --prompts {args.run} --num-prompts 24 --max-new-tokens 64 "
          "--no-speedup", flush=True)


def _specforge_version(folder: Path | None) -> str:
    from importlib import metadata

    try:
        dists = metadata.distributions(path=[str(folder)]) if folder else [metadata.distribution("specforge")]
        return next(d.version for d in dists if d.metadata["Name"] == "specforge")
    except (metadata.PackageNotFoundError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
