"""dflash_train/train/run_folder.py: which settings a run folder was trained with, and how they differ from a
recipe's (a pipeline trains a run again when they do)."""

from pathlib import Path

from dflash_train.train.auto_dtypes import resolve_auto_dtypes
from dflash_train.train.recipe import load_recipe
from dflash_train.train.run_folder import first_difference, trained_otherwise

DEMO = Path(__file__).resolve().parents[3] / "recipes" / "smollm2-135m-demo.yaml"


def _run_folder(tmp_path: Path, overrides: list[str]) -> Path:
    """A run folder as `dflash-train train` leaves it: the resolved config with this machine's dtypes."""
    run = tmp_path / "run"
    run.mkdir()
    resolved = resolve_auto_dtypes(load_recipe(DEMO, overrides))
    (run / "resolved_config.yaml").write_text(resolved.to_yaml())
    return run


def test_a_run_of_the_same_recipe_is_current_and_a_changed_field_is_named(tmp_path):
    run = _run_folder(tmp_path, ["eval.enabled=false"])
    assert trained_otherwise(run, DEMO, ["eval.enabled=false"]) is None
    assert trained_otherwise(run, DEMO, ["eval.enabled=true", "logging.log_every=5"]) is None  # not the drafter's
    assert trained_otherwise(run, DEMO, ["objective.loss=ce"]) == "its `objective.loss` is 'kl', this recipe's 'ce'"
    steps = load_recipe(DEMO, []).recipe.optim.max_steps
    assert trained_otherwise(run, DEMO, ["optim.max_steps=900"]) == \
        f"its `optim.max_steps` is {steps}, this recipe's 900"  # the schedule's length: not a resume of the old run
    assert trained_otherwise(tmp_path / "nothing", DEMO, []) is None


def test_a_run_written_under_another_schema_is_out_of_date_not_an_error(tmp_path):
    run = _run_folder(tmp_path, [])
    cfg = run / "resolved_config.yaml"
    cfg.write_text(cfg.read_text().replace("objective:\n", "objective:\n  retired_field: 3\n", 1))
    why = trained_otherwise(run, DEMO, [])
    assert why.startswith("its resolved_config.yaml no longer loads") and "retired_field" in why


def test_first_difference_walks_nested_sections_and_new_keys():
    assert first_difference({"a": {"b": 1, "c": [1, 2]}}, {"a": {"b": 1, "c": [1, 3]}}) == \
        "its `a.c` is [1, 2], this recipe's [1, 3]"
    assert first_difference({"a": {"b": 1}}, {"a": {"b": 1, "d": None}}) is None  # a new field at its default
    assert first_difference({"a": {"b": 1}}, {"a": {"b": 1, "d": 2}}) == "its `a.d` is None, this recipe's 2"
    assert first_difference({"a": 1}, {"a": 1}) is None
