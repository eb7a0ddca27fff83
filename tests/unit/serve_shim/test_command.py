"""The exact engine argv for every detection case and GPU generation."""

import json

import pytest

from dflash_train.errors import ConfigError
from serve_shim.command import ServeOptions, flag_value, sglang_command, vllm_command, without_flag
from serve_shim.detect import detect_drafter

PY = "/venv/bin/python"
HUB = "org/tiny-target"  # the tiny drafters' verifier (conftest.make_tiny_drafter)
CPU_HEAD = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model"]
GPU_HEAD = [PY, "-m", "vllm.entrypoints.cli.main", "serve"]
KV = ["--kv-cache-memory-bytes", str(1 << 30)]


def opts(**kw):
    return ServeOptions(python=PY, port=8123, **kw)


def spec(**kw):
    return json.dumps(kw, separators=(",", ":"))


@pytest.fixture
def spec_dir(make_tiny_drafter):
    return make_tiny_drafter("spec", block_size=8)


def test_auto_path_cpu(spec_dir):
    argv = vllm_command(detect_drafter(str(spec_dir)), opts(), "cpu")
    assert argv == [*CPU_HEAD, str(spec_dir.resolve()), "--host", "127.0.0.1", "--port", "8123",
                    "--served-model-name", HUB, "--max-num-batched-tokens", "32768", *KV,
                    "--speculative-config",
                    spec(method="dflash", num_speculative_tokens=7, attention_backend="CPU_ATTN")]


@pytest.mark.parametrize("cap, backend", [
    ((8, 0), "FLASH_ATTN"), ((8, 6), "FLASH_ATTN"), ((8, 9), "FLASH_ATTN"),  # Ampere / Ada
    ((9, 0), "FLASH_ATTN"),  # Hopper
    ((10, 0), "FLASH_ATTN"), ((12, 0), "FLASH_ATTN"),  # Blackwell
    ((7, 5), "FLEX_ATTENTION"), ((7, 0), "FLEX_ATTENTION"), ((8, 7), "FLEX_ATTENTION"),
])
def test_auto_path_per_gpu_generation(spec_dir, cap, backend):
    argv = vllm_command(detect_drafter(str(spec_dir)), opts(), cap)
    assert argv == [*GPU_HEAD, str(spec_dir.resolve()), "--host", "127.0.0.1", "--port", "8123",
                    "--served-model-name", HUB, "--max-num-batched-tokens", "32768",
                    "--speculative-config",
                    spec(method="dflash", num_speculative_tokens=7, attention_backend=backend)]


def test_explicit_path_with_target(spec_dir, tmp_path):
    argv = vllm_command(detect_drafter(str(spec_dir)), opts(target=str(tmp_path / "my-target")), (9, 0))
    assert argv == [*GPU_HEAD, str(tmp_path / "my-target"), "--host", "127.0.0.1", "--port", "8123",
                    "--served-model-name", "my-target", "--max-num-batched-tokens", "32768",
                    "--speculative-config",
                    spec(method="dflash", model=str(spec_dir.resolve()), num_speculative_tokens=7,
                         attention_backend="FLASH_ATTN")]


def test_speculators_with_local_verifier_is_explicit(make_tiny_drafter, tmp_path):
    verifier = tmp_path / "local-target"
    verifier.mkdir()
    folder = make_tiny_drafter("spec-local", verifier=str(verifier), block_size=4)
    argv = vllm_command(detect_drafter(str(folder)), opts(), "cpu")
    assert argv == [*CPU_HEAD, str(verifier), "--host", "127.0.0.1", "--port", "8123",
                    "--served-model-name", "local-target", "--max-num-batched-tokens", "32768", *KV,
                    "--speculative-config",
                    spec(method="dflash", model=str(folder.resolve()), num_speculative_tokens=3,
                         attention_backend="CPU_ATTN")]


@pytest.mark.parametrize("verifier, needle", [(None, "name_or_path is empty"),
                                               ("/no/such/target", "neither a hub id nor an existing folder")])
def test_speculators_without_usable_verifier_refused(make_tiny_drafter, verifier, needle):
    folder = make_tiny_drafter("spec-bad", verifier=verifier)
    with pytest.raises(ConfigError, match=needle) as err:
        vllm_command(detect_drafter(str(folder)), opts(), "cpu")
    assert "--target" in str(err.value)


def test_zlab_without_target_refused(make_tiny_drafter):
    folder = make_tiny_drafter("zl", fmt="zlab")
    with pytest.raises(ConfigError, match=r"z-lab config names no verifier.*pass --target"):
        vllm_command(detect_drafter(str(folder)), opts(), (9, 0))
    with pytest.raises(ConfigError, match="pass --target"):
        sglang_command(detect_drafter(str(folder)), str(folder), opts())


def test_zlab_with_target_explicit(make_tiny_drafter):
    folder = make_tiny_drafter("zl", fmt="zlab", block_size=16)
    argv = vllm_command(detect_drafter(str(folder)), opts(target="Qwen/Qwen3-8B"), (8, 0))
    assert argv == [*GPU_HEAD, "Qwen/Qwen3-8B", "--host", "127.0.0.1", "--port", "8123",
                    "--served-model-name", "Qwen/Qwen3-8B", "--max-num-batched-tokens", "32768",
                    "--speculative-config",
                    spec(method="dflash", model=str(folder.resolve()), num_speculative_tokens=15,
                         attention_backend="FLASH_ATTN")]


def test_training_run_serves_newest_checkpoint(make_tiny_drafter, tmp_path):
    make_tiny_drafter("run/checkpoints/step-3", block_size=4)
    step = make_tiny_drafter("run/checkpoints/step-30", block_size=6)
    argv = vllm_command(detect_drafter(str(tmp_path / "run")), opts(), (9, 0))
    assert argv[4] == str(step.resolve())
    assert argv[-1] == spec(method="dflash", num_speculative_tokens=5, attention_backend="FLASH_ATTN")


def test_hub_ids(make_tiny_drafter):
    spec_folder = make_tiny_drafter("hub-spec", block_size=8)
    zlab_folder = make_tiny_drafter("hub-zlab", fmt="zlab", block_size=16)
    auto = vllm_command(detect_drafter("org/spec-drafter", fetch_config=lambda _: spec_folder), opts(), (9, 0))
    assert auto == [*GPU_HEAD, "org/spec-drafter", "--host", "127.0.0.1", "--port", "8123",
                    "--served-model-name", HUB, "--max-num-batched-tokens", "32768", "--speculative-config",
                    spec(method="dflash", num_speculative_tokens=7, attention_backend="FLASH_ATTN")]
    explicit = vllm_command(detect_drafter("z-lab/zl-drafter", fetch_config=lambda _: zlab_folder),
                            opts(target="Qwen/Qwen3-8B"), (9, 0))
    assert explicit[-1] == spec(method="dflash", model="z-lab/zl-drafter", num_speculative_tokens=15,
                                attention_backend="FLASH_ATTN")


def test_user_args_pass_through_and_win(spec_dir):
    extra = ["--enforce-eager", "--max-num-batched-tokens", "4096",
             "--speculative-config", '{"attention_backend":"TRITON_ATTN","num_speculative_tokens":3,"x":1}',
             "--dtype=float32"]
    argv = vllm_command(detect_drafter(str(spec_dir)), opts(target="t/t", served_model_name="m"), (9, 0))
    assert "--served-model-name" in argv and argv[argv.index("--served-model-name") + 1] == "m"
    argv = vllm_command(detect_drafter(str(spec_dir)), opts(target="t/t", served_model_name="m", extra_args=extra),
                        (9, 0))
    assert argv == [*GPU_HEAD, "t/t", "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "m",
                    "--speculative-config",
                    spec(method="dflash", model=str(spec_dir.resolve()), num_speculative_tokens=3,
                         attention_backend="TRITON_ATTN", x=1),
                    "--enforce-eager", "--max-num-batched-tokens", "4096", "--dtype=float32"]


def test_draft_backend_override_and_user_kv_cache(spec_dir):
    argv = vllm_command(detect_drafter(str(spec_dir)),
                        opts(draft_attention_backend="FLEX_ATTENTION",
                             extra_args=["--kv-cache-memory-bytes=1000", "--speculative-config={\"enforce_eager\":true}"]),
                        "cpu")
    assert argv == [*CPU_HEAD, str(spec_dir.resolve()), "--host", "127.0.0.1", "--port", "8123",
                    "--served-model-name", HUB, "--max-num-batched-tokens", "32768", "--speculative-config",
                    spec(method="dflash", num_speculative_tokens=7, attention_backend="FLEX_ATTENTION",
                         enforce_eager=True),
                    "--kv-cache-memory-bytes=1000"]


def test_locked_keys_and_bad_json(spec_dir):
    d = detect_drafter(str(spec_dir))
    with pytest.raises(ConfigError, match="drop `method`"):
        vllm_command(d, opts(extra_args=["--speculative-config", '{"method":"eagle3"}']), "cpu")
    with pytest.raises(ConfigError, match="drop `model`"):
        vllm_command(d, opts(target="t/t", extra_args=["--speculative-config", '{"model":"other"}']), "cpu")
    # the same values are harmless
    same = vllm_command(d, opts(extra_args=["--speculative-config", '{"method":"dflash"}']), "cpu")
    assert json.loads(same[-1])["method"] == "dflash"
    with pytest.raises(ConfigError, match="not valid JSON"):
        vllm_command(d, opts(extra_args=["--speculative-config", "{oops"]), "cpu")
    with pytest.raises(ConfigError, match="--port after `--`"):
        vllm_command(d, opts(extra_args=["--port", "1"]), "cpu")


def test_sglang_argv(make_tiny_drafter):
    folder = make_tiny_drafter("zl", fmt="zlab", block_size=16)
    d = detect_drafter(str(folder))
    argv = sglang_command(d, str(folder), opts(engine="sglang", target="Qwen/Qwen3-8B", extra_args=["--tp", "2"]))
    assert argv == [PY, "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B", "--host", "127.0.0.1",
                    "--port", "8123", "--served-model-name", "Qwen/Qwen3-8B", "--speculative-algorithm", "DFLASH",
                    "--speculative-draft-model-path", str(folder), "--speculative-num-draft-tokens", "16",
                    "--tp", "2"]
    spec_folder = make_tiny_drafter("spec", block_size=8)  # verifier is a hub id: no --target needed
    argv = sglang_command(detect_drafter(str(spec_folder)), "/cache/zl", opts(engine="sglang"))
    assert argv[3:5] == ["--model-path", HUB] and argv[-4:] == [
        "--speculative-draft-model-path", "/cache/zl", "--speculative-num-draft-tokens", "8"]


def test_flag_helpers():
    args = ["--a", "1", "--b=2", "--a", "3", "--c"]
    assert flag_value(args, "--a") == "3" and flag_value(args, "--b") == "2" and flag_value(args, "--d") is None
    assert without_flag(args, "--a") == ["--b=2", "--c"]
    assert without_flag(args, "--b") == ["--a", "1", "--a", "3", "--c"]


@pytest.mark.parametrize("extra", [
    ["--speculative-config", '{"num_speculative_tokens":3,"enforce_eager":true}'],
    ['-sc={"num_speculative_tokens":3,"enforce_eager":true}'],
    ["--speculative-config.num_speculative_tokens", "3", "--speculative-config.enforce_eager=true"],
    ["--spec-tokens=3", "--speculative-config", '{"enforce_eager":true}'],
    ["--spec-tokens", "9", "-sc", '{"enforce_eager":true}', "--spec-tokens", "3"],  # the last one wins, as in vLLM
])
def test_every_form_of_the_users_speculative_settings_is_merged_once(spec_dir, extra):
    argv = vllm_command(detect_drafter(str(spec_dir)), opts(extra_args=[*extra, "--enforce-eager"]), "cpu")
    assert argv[-3:] == ["--speculative-config", spec(method="dflash", num_speculative_tokens=3,
                                                      attention_backend="CPU_ATTN", enforce_eager=True),
                         "--enforce-eager"]
    assert sum(a.startswith(("--speculative-config", "-sc", "--spec-")) for a in argv) == 1


@pytest.mark.parametrize("extra, needle", [
    (["--speculative-config", '{"num_speculative_tokens":8}'], "num_speculative_tokens 8 "),
    (["--spec-tokens", "20"], "num_speculative_tokens 20 "),
    (["--speculative-config.num_speculative_tokens=0"], "num_speculative_tokens 0 "),
    (["-sc", '{"num_speculative_tokens":"7"}'], "num_speculative_tokens '7' "),
])
def test_more_draft_tokens_than_the_block_holds_are_refused(spec_dir, extra, needle):
    d = detect_drafter(str(spec_dir))  # block size 8
    with pytest.raises(ConfigError, match=needle + r"\(set after `--`\): .* has block size 8, so it drafts 1..7 "
                                                   "tokens per step; pass at most 7"):
        vllm_command(d, opts(extra_args=extra), "cpu")
    with pytest.raises(ConfigError, match="drop `method`"):
        vllm_command(d, opts(extra_args=["--spec-method", "eagle3"]), "cpu")
    with pytest.raises(ConfigError, match="--spec-tokens after `--` needs a value"):
        vllm_command(d, opts(extra_args=["--spec-tokens"]), "cpu")


def test_sglang_draft_tokens_above_the_block_are_refused(make_tiny_drafter):
    d = detect_drafter(str(make_tiny_drafter("zl", fmt="zlab", block_size=16)))
    fine = sglang_command(d, "/z", opts(engine="sglang", target="t/t", extra_args=["--speculative-num-draft-tokens", "8"]))
    assert fine[-2:] == ["--speculative-num-draft-tokens", "8"] and fine.count("--speculative-num-draft-tokens") == 1
    for bad in ("17", "1", "x"):
        with pytest.raises(ConfigError, match=f"--speculative-num-draft-tokens {bad} .*block size 16; SGLang takes 2..16"):
            sglang_command(d, "/z", opts(engine="sglang", target="t/t",
                                         extra_args=[f"--speculative-num-draft-tokens={bad}"]))
