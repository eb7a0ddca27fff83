"""Every recipe under recipes/ (recursively) validates and dry-runs; the schema rejects bad fields by dotted path."""

import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.errors import ConfigError
from dflash_train.train.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(ROOT.rglob("*.yaml")) + sorted(ROOT.rglob("*.yml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"smollm2-135m-demo.yaml", "smollm2-135m-gpu.yaml", "qwen3-8b-b16.yaml", "llama3.1-8b-instruct-b16.yaml",
            "qwen3.5-9b-b16.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_validates_and_has_header(path):
    head = path.read_text().splitlines()[:6]
    for word in ("# target:", "# purpose:", "# run:"):
        assert any(line.startswith(word) for line in head), f"{path}: header lacks `{word}`"
    resolved = load_recipe(path)
    assert resolved.recipe.drafter.block_size >= 2
    # the resolved YAML (with its provenance comments) loads back to the same recipe
    tmp = path.parent / f".roundtrip-{path.name}"
    try:
        tmp.write_text(resolved.to_yaml())
        assert load_recipe(tmp).recipe == resolved.recipe
    finally:
        tmp.unlink(missing_ok=True)


def test_paper_recipe_values():
    r = load_recipe(ROOT / "qwen3-8b-b16.yaml").recipe
    assert (r.drafter.num_layers, r.drafter.block_size, r.drafter.num_features, r.drafter.mask_token_id) == (5, 16, 5, 151669)
    assert (r.optim.lr, r.optim.warmup_ratio, r.optim.grad_clip, r.optim.epochs) == (6e-4, 0.04, 1.0, 6)
    assert (r.data.max_length, r.objective.anchors_per_document, r.engine.zero_stage) == (3072, 512, 2)
    assert load_recipe(ROOT / "qwen3.5-9b-b16.yaml").recipe.drafter.mask_token_id == 248070
    demo = load_recipe(ROOT / "smollm2-135m-demo.yaml").recipe
    assert demo.target is None and demo.drafter.block_size == 4 and demo.drafter.mask_token_id == 16
    assert demo.objective.anchors_per_document == 32  # 32 blocks of 4: the block tokens of 16 of 8
    # the demo mixes casual chat with ShareGPT (eval reports tau per source); features are cached once
    from dflash_train.train.recipe import source_label

    assert [source_label(s) for s in demo.data.source] == ["chitchat", "sharegpt"]
    assert demo.data.features == "offline" and demo.data.holdout_fraction > 0
    # issue 31's settings: KL to the target's top k among the draft ids with the reduced head trained (the demo's
    # reduced vocabulary), and the prefix weighting every recipe carries
    assert (demo.objective.loss, demo.objective.kl_teacher, demo.drafter.train_lm_head) == ("kl", "draft_vocab", True)
    # round 11: the prompts' positions on the target's greedy tokens, at a lower learning rate
    assert (demo.objective.positions, demo.objective.labels, demo.optim.lr) == ("all", "greedy", 1.4e-3)
    assert all(load_recipe(p).recipe.objective.prefix_weighting for p in RECIPES), \
        [p.name for p in RECIPES if not load_recipe(p).recipe.objective.prefix_weighting]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_dry_runs(path):
    res = subprocess.run([str(Path(sys.executable).parent / "dflash-train"), "train", "--config", str(path),
                          "--dry-run"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "block_size:" in res.stdout and "attention:" in res.stdout


def test_gpu_recipes_use_auto_attention_and_bf16():
    for name in ("qwen3-8b-b16.yaml", "llama3.1-8b-instruct-b16.yaml", "qwen3.5-9b-b16.yaml"):
        r = load_recipe(ROOT / name).recipe
        assert (r.objective.attention, r.engine.precision, r.engine.activation_checkpointing) == ("auto", "bf16", True)
    g = load_recipe(ROOT / "smollm2-135m-gpu.yaml").recipe
    assert g.target is None and g.data.source == "sharegpt" and g.data.max_turns == 1 and g.data.regenerate.enabled
    assert g.drafter.block_size == 16 and 2 <= g.drafter.num_layers <= 3 and g.drafter.draft_vocab_size is None
    assert (g.objective.attention, g.objective.logits_chunk, g.engine.precision) == ("auto", "auto", "bf16")
    assert g.data.holdout_fraction > 0 and g.eval.enabled


def test_overrides_beat_recipe_beat_defaults():
    r = load_recipe(ROOT / "smollm2-135m-demo.yaml", ["optim.lr=2e-4", "drafter.num_layers=2", "eval.enabled=false"])
    assert r.recipe.optim.lr == 2e-4 and r.recipe.drafter.num_layers == 2 and r.recipe.eval.enabled is False
    assert r.sources["optim.lr"] == "--set" and r.sources["optim.schedule"] == "recipe"
    text = r.to_yaml()
    assert "lr: 0.0002  # --set" in text and "min_lr_ratio: 0.0  # default" in text


def test_anchor_density_overrides_the_demo_count_and_round_trips(tmp_path):
    r = load_recipe(ROOT / "smollm2-135m-demo.yaml", ["objective.anchor_density.fraction=0.2",
                                                       "objective.anchor_density.max=48"])
    o = r.recipe.objective
    assert o.anchor_density.as_tuple() == (0.2, 1, 48) and r.sources["objective.anchor_density.fraction"] == "--set"
    assert load_recipe(ROOT / "smollm2-135m-demo.yaml").recipe.objective.anchor_density is None  # the count decides
    (tmp_path / "r.yaml").write_text(r.to_yaml())
    assert load_recipe(tmp_path / "r.yaml").recipe == r.recipe


@pytest.mark.parametrize("override, needle", [
    ("optim.lrr=1", "optim.lrr: unknown field"),
    ("drafter.block_size=1", "drafter.block_size"),
    ("optim.lr=fast", "optim.lr"),
    ("objective.loss=mse", "objective.loss"),
    ("nonsense", "key=value"),
    ("objective.anchor_density.fraction=1.5", "objective.anchor_density.fraction"),
    ("objective.anchor_density.share=0.2", "objective.anchor_density.share: unknown field"),
    ("objective.anchor_density={fraction: 0.2, min: 9, max: 4}", "max 4 is below min 9"),
])
def test_bad_fields_name_their_path(override, needle):
    with pytest.raises(ConfigError) as err:
        load_recipe(ROOT / "smollm2-135m-demo.yaml", [override])
    assert needle in str(err.value)


def test_unknown_field_in_file_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {prepared: x, holdout: 0.1}\n")
    with pytest.raises(ConfigError, match=r"data\.holdout: unknown field"):
        load_recipe(bad)
