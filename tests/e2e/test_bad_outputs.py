"""Bad output paths given to the installed commands, one case per class (issue 15): each is refused
with exit code 2 and one `error:` line naming the path, no traceback, and the file tree (paths,
sizes, sha256) is byte-for-byte what it was. Plus --resume / --resume auto and the fallback past a
damaged newest checkpoint on the real SmolLM2 target."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import refused, tree

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "convert"))
from convert_fixtures import smollm2_cfg, write_drafter  # noqa: E402

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent  # the scripts beside this interpreter (CI does not activate the venv)


def cli(exe: str, *args, cwd=None, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([str(BIN / exe), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)




@pytest.fixture
def drafter(tmp_path):
    return write_drafter(tmp_path / "src")


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "thesis.tex").write_text("\\section{Results} do not lose this\n")
    (path / "data.bin").write_bytes(os.urandom(4096))
    return path


# ---- dflash-convert -----------------------------------------------------------------------

@pytest.mark.parametrize("command", ["to-zlab", "to-speculators"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_convert_onto_a_user_folder(tmp_path, drafter, command, overwrite):
    mine = user_folder(tmp_path / "mine")
    before = tree(tmp_path)
    refused(cli("dflash-convert", command, drafter, mine, *overwrite), f"OUT {mine}:", "not a dflash-toolkit output")
    assert tree(tmp_path) == before


def test_convert_onto_a_regular_file(tmp_path, drafter):
    target = tmp_path / "model.safetensors"
    target.write_bytes(os.urandom(1000))
    before = tree(tmp_path)
    refused(cli("dflash-convert", "to-speculators", drafter, target, "--overwrite"), f"OUT {target}:",
            "is a file, not a folder")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", ["to-zlab", "to-speculators"])
def test_convert_into_the_source_run(tmp_path, command):
    run = tmp_path / "run"
    write_drafter(run / "final")  # a toolkit output: only the source rule protects it from --overwrite
    (run / "summary.json").write_text('{"steps": 3}')
    before = tree(tmp_path)
    refused(cli("dflash-convert", command, run, run / "final", "--overwrite"), f"OUT {run / 'final'}:",
            f"lies inside the source {run}")
    refused(cli("dflash-convert", command, run / "final", run, "--overwrite"), f"OUT {run}:",
            f"contains the source {run / 'final'}")
    assert tree(tmp_path) == before


def test_convert_onto_the_source_itself(tmp_path, drafter):
    before = tree(tmp_path)
    refused(cli("dflash-convert", "to-zlab", drafter, drafter, "--overwrite"), f"OUT {drafter}:",
            f"is the source {drafter}")
    assert tree(tmp_path) == before


def test_convert_replaces_its_own_output_only_with_overwrite(tmp_path, drafter):
    out = tmp_path / "z"
    assert cli("dflash-convert", "to-zlab", drafter, out).returncode == 0
    before = tree(tmp_path)
    refused(cli("dflash-convert", "to-zlab", drafter, out), f"OUT {out}:", "earlier dflash-toolkit output (to-zlab",
            "--overwrite")
    assert tree(tmp_path) == before
    done = cli("dflash-convert", "to-zlab", drafter, out, "--overwrite")
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "z"]  # no temp or old copy left


# ---- dflash-train prepare -----------------------------------------------------------------

@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "response": " ".join(map(str, range(i + 2)))})
                            + "\n" for i in range(3)))
    return path


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_prepare_onto_a_user_folder(tmp_path, chats, overwrite):
    mine = user_folder(tmp_path / "mine")
    before = tree(tmp_path)
    refused(cli("dflash-train", "prepare", "--data", chats, "--output", mine, "--max-samples", "2", *overwrite),
            f"--output {mine}:", "not a dflash-toolkit output")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("output", [".", ".."])
def test_prepare_onto_the_current_folder_or_its_parent(tmp_path, chats, output):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(chats, work / "chats.jsonl")
    before = tree(tmp_path)
    refused(cli("dflash-train", "prepare", "--data", "chats.jsonl", "--output", output, "--overwrite", cwd=work),
            f"--output {output}:", "current folder")
    assert tree(tmp_path) == before


def test_prepare_output_inside_its_source_folder(tmp_path, chats):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(chats, data / "chats.jsonl")
    before = tree(tmp_path)
    refused(cli("dflash-train", "prepare", "--data", data, "--output", data / "prepared"),
            f"--output {data / 'prepared'}:", f"lies inside the source {data}")
    assert tree(tmp_path) == before


# ---- dflash-train eval: unwritable and foreign report files --------------------------------

@pytest.fixture
def eval_inputs(tmp_path):
    draft = write_drafter(tmp_path / "drafter", smollm2_cfg())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 12 + 7?"}) + "\n")
    empty_target = tmp_path / "no-model-here"  # loading it would fail: an early error proves the order
    empty_target.mkdir()
    return draft, prompts, empty_target


def test_eval_json_in_an_unwritable_folder_fails_first(tmp_path, eval_inputs, unwritable_dir):
    draft, prompts, empty_target = eval_inputs
    report = unwritable_dir / "eval" / "report.json"
    before = tree(tmp_path)
    refused(cli("dflash-train", "eval", "--draft", draft, "--prompts", prompts, "--target", empty_target,
                "--json", report), f"--json {report}:", f"cannot write in {unwritable_dir}")
    assert tree(tmp_path) == before


def test_eval_never_replaces_a_user_file(tmp_path, eval_inputs):
    draft, prompts, empty_target = eval_inputs
    mine = tmp_path / "results.json"
    mine.write_text('{"tau": 3.1, "notes": "mine"}')
    before = tree(tmp_path)
    refused(cli("dflash-train", "eval", "--draft", draft, "--prompts", prompts, "--target", empty_target,
                "--json", mine, "--overwrite"), f"--json {mine}:", "not a dflash-toolkit output")
    refused(cli("dflash-train", "eval", "--draft", draft, "--prompts", prompts, "--target", empty_target,
                "--plot", draft / "config.json", "--overwrite"), f"--plot {draft / 'config.json'}:",
            f"lies inside the source {draft}")
    assert tree(tmp_path) == before


# ---- dflash-train train: --output and --resume --------------------------------------------

@pytest.fixture(scope="module")
def recipe(tmp_path_factory, smollm2_path):
    from conftest import make_train_prepared

    root = tmp_path_factory.mktemp("bad-outputs-train")
    rows = make_train_prepared(root / "rows", smollm2_path, n=12)
    path = root / "tiny.yaml"
    path.write_text(f"""# target: SmolLM2 (embedded)
data: {{prepared: {rows}, features: memory, holdout_fraction: 0.25}}
drafter: {{num_layers: 1, block_size: 4, mask_token_id: 16, dtype: float32}}
objective: {{anchors_per_document: 16, logits_chunk: 256}}
optim: {{lr: 1.0e-3, epochs: 1}}
batch: {{tokens_per_microbatch: 512}}
checkpoint: {{save_every: 1, keep_last: 3}}
logging: {{log_every: 1, eval_every: 100, progress: false}}
""")
    return path


@pytest.fixture(scope="module")
def auto_run(recipe, tmp_path_factory):
    """`--resume auto` on a new folder starts the run: two steps, two checkpoints, final/."""
    out = tmp_path_factory.mktemp("auto") / "run"
    res = cli("dflash-train", "train", "--config", recipe, "--output", out, "--max-steps", "2", "--resume", "auto")
    return out, res


def train(recipe, out, *args):
    return cli("dflash-train", "train", "--config", recipe, "--output", out, "--max-steps", "2", *args)


def test_resume_with_nothing_to_resume(tmp_path, recipe):
    before = tree(tmp_path)
    refused(train(recipe, tmp_path / "new-run", "--resume"), "--resume:", str(tmp_path / "new-run"),
            "no training run to resume", "--resume auto")
    assert tree(tmp_path) == before and not (tmp_path / "new-run").exists()


def test_resume_still_refuses_a_foreign_folder(tmp_path, recipe):
    mine = user_folder(tmp_path / "mine")
    before = tree(tmp_path)
    for mode in (["--resume"], ["--resume", "auto"]):
        refused(train(recipe, mine, *mode), f"--output {mine}:", "not a dflash-toolkit output")
    assert tree(tmp_path) == before


def test_train_output_in_an_unwritable_folder_fails_before_the_target(tmp_path, recipe, unwritable_dir):
    bad_target = tmp_path / "no-model-here"
    bad_target.mkdir()
    text = recipe.read_text().replace("# target: SmolLM2 (embedded)", f"target: {bad_target}")
    local = tmp_path / "recipe.yaml"
    local.write_text(text)
    before = tree(tmp_path)
    out = unwritable_dir / "runs" / "r1"
    refused(train(local, out), f"--output {out}:", f"cannot write in {unwritable_dir}")
    assert tree(tmp_path) == before


@pytest.mark.slow
def test_resume_auto_starts_a_new_run(auto_run):
    out, res = auto_run
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from" not in res.stderr and "Traceback" not in res.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    assert json.loads((out / ".dflash-output.json").read_text())["command"] == "train"


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_to_the_one_before(auto_run, tmp_path, recipe):
    from safetensors.torch import load_file

    src, res = auto_run
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "run"
    shutil.copytree(src, out)
    engine_file = out / "checkpoints" / "step-000002" / "trainer_state" / "engine" / "mp_rank_00_model_states.pt"
    os.truncate(engine_file, engine_file.stat().st_size // 2)
    done = train(recipe, out, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    warn = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warn) == 1 and str(out / "checkpoints" / "step-000002") in warn[0] and "truncated" in warn[0]
    assert f"resuming from {out / 'checkpoints' / 'step-000001'} (step 1)" in done.stderr
    # step 2 was trained again from step 1: the same drafter as the uninterrupted run, and a whole checkpoint
    a, b = load_file(str(src / "final" / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert all(float((a[k] - b[k]).abs().max()) < 1e-6 for k in a)
    from dflash_train.train.checkpointing import checkpoint_problem

    assert checkpoint_problem(out / "checkpoints" / "step-000002") is None


@pytest.mark.slow
def test_every_checkpoint_damaged_is_a_clear_error(auto_run, tmp_path, recipe):
    src, res = auto_run
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "run"
    shutil.copytree(src, out)
    for step in ("step-000001", "step-000002"):
        (out / "checkpoints" / step / "trainer_state" / "state.json").write_text("{")
    before = tree(tmp_path)
    for mode in (["--resume"], ["--resume", "auto"]):
        refused(train(recipe, out, *mode), "--resume: every checkpoint in", str(out / "checkpoints"),
                "state.json is unreadable")
    assert tree(tmp_path) == before


@pytest.mark.slow
def test_resume_past_the_runs_last_step_changes_nothing(auto_run, tmp_path, recipe):
    src, res = auto_run
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "run"
    shutil.copytree(src, out)
    before = tree(tmp_path)
    proc = cli("dflash-train", "train", "--config", recipe, "--output", out, "--max-steps", "1", "--resume")
    refused(proc, f"--resume: the run in {out} is already at step 2, past this recipe's last step 1",
            "nothing was changed", "--max-steps above 2")
    assert tree(tmp_path) == before
    # at its last step already: nothing to do, said so, nothing rewritten
    done = train(recipe, out, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"the run in {out} already finished at step 2; nothing to do" in done.stderr
    assert tree(tmp_path) == before
