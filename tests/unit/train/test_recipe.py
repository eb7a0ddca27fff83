"""Recipe loading errors and drafter.init_from: conflicts named, the loaded drafter's values recorded."""

from __future__ import annotations

import pytest

from dflash_train.errors import ConfigError
from dflash_train.train.init_from import apply_init_from, resolve_init_from
from dflash_train.train.recipe import load_recipe


def _resolved(*overrides, drafter="init_from: /d"):
    return load_recipe(None, list(overrides), base={"data": {"prepared": "/rows"}, "drafter": _flow(drafter)})


def _flow(text):
    import yaml

    return yaml.safe_load("{" + text + "}")


def test_fields_the_user_did_not_set_come_from_the_drafter_and_say_so(tiny_config):
    # tiny_config: 2 layers, block 8, mask 100, aux ids [2, 4, 6] (z-lab [1, 3, 5]), intermediate 128
    out = apply_init_from(_resolved(), tiny_config)
    d = out.recipe.drafter
    assert (d.num_layers, d.block_size, d.mask_token_id, d.num_features, d.target_layer_ids,
            d.intermediate_size, d.draft_vocab_size) == (2, 8, 100, 3, [1, 3, 5], 128, None)
    text = out.to_yaml()
    assert "  num_layers: 2  # drafter.init_from\n" in text and "  block_size: 8  # drafter.init_from\n" in text
    assert "  target_layer_ids: [1, 3, 5]  # drafter.init_from\n" in text
    assert "  num_layers: 1" not in text and "block_size: 16" not in text  # defaults that were never used
    # idempotent: the recorded config resolves to itself
    assert apply_init_from(out, tiny_config).to_yaml() == text


def test_conflicting_user_fields_are_all_named(tiny_config):
    resolved = _resolved("drafter.num_layers=3", "drafter.target_layer_ids=[1,3,5]",
                         drafter="init_from: /d, block_size: 16, mask_token_id: 100")
    with pytest.raises(ConfigError) as info:
        apply_init_from(resolved, tiny_config)
    text = str(info.value)
    assert text.startswith("drafter.init_from /d: ")
    assert "drafter.num_layers is 3 but the drafter has 2" in text and "drafter.block_size is 16 but the drafter has 8" in text
    assert "target_layer_ids" not in text and "mask_token_id" not in text  # set, but equal
    with pytest.raises(ConfigError, match="drafter.draft_vocab_size is 64 but the drafter has None"):
        apply_init_from(_resolved("drafter.draft_vocab_size=64"), tiny_config)
    # the full vocabulary written out is the same drafter
    assert apply_init_from(_resolved("drafter.draft_vocab_size=101"), tiny_config).recipe.drafter.draft_vocab_size == 101
    with pytest.raises(ConfigError, match="init_from_target_layer and drafter.init_from both"):
        apply_init_from(_resolved("drafter.init_from_target_layer=-1"), tiny_config)


def test_resolve_init_from_reads_the_folder(tmp_path, tiny_config):
    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.model.modeling_dflash import DFlashDraftModel

    save_drafter(DFlashDraftModel(tiny_config), tmp_path / "d")
    out = resolve_init_from(_resolved(drafter=f"init_from: {tmp_path / 'd'}"))
    assert out.recipe.drafter.num_layers == 2 and out.sources["drafter.num_layers"] == "drafter.init_from"
    assert resolve_init_from(_resolved(drafter="num_layers: 2")).recipe.drafter.block_size == 16  # no init_from
    with pytest.raises(ConfigError, match=f"drafter.init_from {tmp_path / 'nope'}: .*no config.json"):
        resolve_init_from(_resolved(drafter=f"init_from: {tmp_path / 'nope'}"))


def test_unreadable_config_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=f"--config {tmp_path}: is a folder; give a recipe YAML file"):
        load_recipe(tmp_path)
    (tmp_path / "r.yaml").write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ConfigError, match="--config .*r.yaml: not UTF-8 text"):
        load_recipe(tmp_path / "r.yaml")
    with pytest.raises(ConfigError, match="--config .*absent.yaml: file not found"):
        load_recipe(tmp_path / "absent.yaml")


@pytest.mark.slow
def test_training_from_a_saved_drafter_uses_and_records_its_shape(tmp_path, train_tiny_target, train_prepared):
    """A real run (installed command, tiny target): the drafter's 2 layers and block 6 are trained and
    recorded, not the recipe defaults (1 layer, block 16)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.model.init import new_drafter_for_target

    save_drafter(new_drafter_for_target(str(train_tiny_target), num_layers=2, block_size=6, mask_token_id=16,
                                        num_features=2, dtype="float32"), tmp_path / "start")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""target: {train_tiny_target}
data: {{prepared: {train_prepared}, features: memory, holdout_fraction: 0.2}}
drafter: {{init_from: {tmp_path / 'start'}, mask_token_id: 16, dtype: float32}}
objective: {{anchor_density: {{fraction: 0.5, min: 2, max: 8}}, logits_chunk: 64}}
batch: {{tokens_per_microbatch: 256}}
logging: {{log_every: 1, eval_every: 100, progress: false}}
""")
    bin_dir = Path(sys.executable).parent
    res = subprocess.run([str(bin_dir / "dflash-train"), "train", "--config", str(recipe), "--output",
                          str(tmp_path / "run"), "--max-steps", "1"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert res.returncode == 0, res.stderr[-3000:]
    resolved = (tmp_path / "run" / "resolved_config.yaml").read_text()
    for line in ("  num_layers: 2  # drafter.init_from", "  block_size: 6  # drafter.init_from",
                 "  num_features: 2  # drafter.init_from", "  mask_token_id: 16  # recipe",
                 "    fraction: 0.5  # recipe"):  # a density of anchors trains as well as a count
        assert line in resolved, line
    final = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert final["transformer_layer_config"]["num_hidden_layers"] == 2 and final["block_size"] == 6


def test_a_data_mixture_lists_sources_with_their_own_counts_and_labels():
    r = load_recipe(None, ["data.train_fraction=0.25"],
                    base={"data": {"max_samples": 100, "source": [{"source": "chitchat"},
                                                                  {"source": "/d/code.jsonl", "max_samples": 7},
                                                                  {"source": "org/math-set", "label": "math"}]}})
    from dflash_train.train.recipe import source_label

    data = r.recipe.data
    assert [source_label(s) for s in data.source] == ["chitchat", "code", "math"]
    assert data.source_names() == ["chitchat", "/d/code.jsonl", "org/math-set"]
    assert data.source[1].max_samples == 7 and data.train_fraction == 0.25
    with pytest.raises(ConfigError, match="two sources share the label 'chat'"):
        load_recipe(None, [], base={"data": {"source": [{"source": "a/chat"}, {"source": "b/chat.json"}]}})
    with pytest.raises(ConfigError, match="data.source"):
        load_recipe(None, [], base={"data": {"source": [{"name": "chitchat"}]}})
    with pytest.raises(ConfigError, match="train_fraction"):
        load_recipe(None, ["data.train_fraction=0"], base={"data": {"source": "chitchat"}})


def test_a_block_size_past_the_bound_is_refused_by_name():
    from dflash_train.model.config import MAX_BLOCK_SIZE

    base = {"data": {"prepared": "/p"}}
    assert load_recipe(None, [f"drafter.block_size={MAX_BLOCK_SIZE}"], base=base).recipe.drafter.block_size == 64
    with pytest.raises(ConfigError, match=r"drafter.block_size: Input should be less than or equal to 64"):
        load_recipe(None, ["drafter.block_size=1000000"], base=base)


@pytest.mark.parametrize(("pick", "dtype", "precision"), [("float32", "float32", "fp32"),
                                                          ("bfloat16", "bfloat16", "bf16-mixed")])
def test_auto_dtypes_resolve_by_the_machine_and_say_why(monkeypatch, pick, dtype, precision):
    """Every `auto` dtype and precision becomes the machine's pick, its layer saying why; fields the
    recipe set stay as set; regeneration's dtype stays auto while regeneration is off (no cache key moves)."""
    from dflash_train.train.auto_dtypes import dtype_fields, resolve_auto_dtypes

    monkeypatch.setenv("DFLASH_AUTO_DTYPE", pick)
    base = {"data": {"source": "chitchat", "regenerate": {"enabled": True}}}
    r = resolve_auto_dtypes(load_recipe(None, ["engine.precision=bf16"], base=base), "cpu")
    assert dtype_fields(r) == {"data.regenerate.dtype": {"value": dtype, "set_by": f"auto: DFLASH_AUTO_DTYPE={pick}"},
                          "data.target_dtype": {"value": dtype, "set_by": f"auto: DFLASH_AUTO_DTYPE={pick}"},
                          "engine.precision": {"value": "bf16", "set_by": "--set"}}
    assert f"target_dtype: {dtype}  # auto: DFLASH_AUTO_DTYPE={pick}" in r.to_yaml()
    cuda = resolve_auto_dtypes(load_recipe(None, [], base={"data": {"prepared": "/rows"}}), "cuda")
    assert (cuda.recipe.engine.precision, cuda.recipe.data.target_dtype) == ("bf16", "bfloat16")
    assert cuda.recipe.data.regenerate.dtype == "auto"  # regeneration is off: nothing is keyed by it


def test_the_demo_recipe_leaves_dtypes_to_the_machine(tmp_path):
    """`dflash-train train --dry-run` on the demo recipe prints what `auto` picked and why."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "smollm2-135m-demo.yaml"
    from dflash_train.train.auto_dtypes import dtype_fields

    r = load_recipe(recipe)
    assert [v["value"] for v in dtype_fields(r).values()] == ["auto", "auto", "auto"]
    from dflash_train.machine import cpu_bf16_instructions

    cli = Path(sys.executable).parent / "dflash-train"
    # on a CPU without bf16 instructions the cap changes nothing: the CPU itself is the reason
    capped = "ONEDNN_MAX_CPU_ISA=AVX2" if cpu_bf16_instructions() else "this CPU has no bf16 instructions"
    for env, dtype, precision, why in (({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "float32", "fp32", capped),
                                       ({"DFLASH_AUTO_DTYPE": "bfloat16"}, "bfloat16", "bf16-mixed",
                                        "DFLASH_AUTO_DTYPE=bfloat16")):
        clean = {k: v for k, v in os.environ.items() if k != "DFLASH_AUTO_DTYPE"}
        out = subprocess.run([str(cli), "train", "--config", str(recipe), "--dry-run"], capture_output=True,
                             text=True, env={**clean, **env}, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert f"dtype: {dtype}  # auto: " in out.stdout and why in out.stdout
        assert f"precision: {precision}  # auto: " in out.stdout


def test_a_kl_teacher_over_the_draft_vocabulary_needs_one():
    from dflash_train.errors import ConfigError

    base = {"data": {"prepared": "rows"}, "objective": {"loss": "kl", "kl_teacher": "draft_vocab"}}
    with pytest.raises(ConfigError, match="kl_teacher: draft_vocab needs a reduced vocabulary.*draft_vocab_size"):
        load_recipe(None, base=base)
    ok = load_recipe(None, base={**base, "drafter": {"draft_vocab_size": 64}}).recipe.objective
    assert ok.kl_teacher == "draft_vocab"
    with pytest.raises(ConfigError, match="objective.kl_teacher"):
        load_recipe(None, base=base, overrides=["objective.kl_teacher=draft"])


def test_prefix_smoothing_without_prefix_weighting_is_refused_by_name():
    base = {"data": {"prepared": "rows"}}
    with pytest.raises(ConfigError, match="objective.prefix_smoothing is set but objective.prefix_weighting is false"):
        load_recipe(None, base={**base, "objective": {"prefix_smoothing": 0.5}})
    for kind in (True, "expected_length"):
        o = load_recipe(None, base={**base, "objective": {"prefix_weighting": kind, "prefix_smoothing": 0.3}}).recipe.objective
        assert o.prefix_weighting == kind and o.prefix_smoothing == 0.3
    with pytest.raises(ConfigError, match="prefix_weighting"):
        load_recipe(None, base={**base, "objective": {"prefix_weighting": "expected"}})


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    """YAML readers keep the last of two equal keys and drop the first silently: a recipe with two `optim:`
    sections (or a field written twice) is refused, naming the key and both lines; a merge key's override stays."""
    from dflash_train.train.recipe import load_recipe

    twice = tmp_path / "twice.yaml"
    twice.write_text("optim:\n  lr: 1.0e-3\ndrafter:\n  num_layers: 2\noptim:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: not valid YAML: `optim` is given twice \(lines 1 and 5\)"):
        load_recipe(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  lr: 1.0e-3\n  epochs: 2\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r"`lr` is given twice \(lines 2 and 4\)"):
        load_recipe(nested)
    from dflash_train.train.recipe_yaml import load_yaml

    # a merged key given again overrides it: what merge keys are for
    assert load_yaml("a: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n") == {"a": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}}
    with pytest.raises(ConfigError, match="`x` is given twice"):
        load_recipe(None, ["optim={x: 1, x: 2}"])
