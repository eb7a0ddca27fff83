"""Publishing a drafter: validate, write a model card, upload only the checkpoint files.

The token comes from the environment (`--token-env`, default HF_TOKEN) or the HF cache and is
handed to huggingface_hub only; it never reaches a message, a log line or the card.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.errors import CheckpointError, ConfigError, DFlashError
from dflash_train.model import formats
from dflash_train.model.weights import INDEX_FILE, weight_files

CARD_FILE = "README.md"
SUMMARY_FILE = "summary.json"
EXTRA_FILES = ("mask_embedding.pt",)


class HubError(DFlashError):
    """The hub refused a request (auth, permissions, network)."""


@dataclass
class PushPlan:
    folder: Path
    repo_id: str
    files: list[str]          # paths in the repo, sorted
    card: str
    revision: str | None = None
    private: bool = False
    notes: list[str] = field(default_factory=list)


def find_summary(folder: Path) -> dict[str, Any] | None:
    """The trainer's summary.json in the checkpoint folder or up to two folders above it."""
    for place in (folder, folder.parent, folder.parent.parent):
        path = place / SUMMARY_FILE
        if path.is_file():
            try:
                return json.loads(path.read_text())
            except ValueError:
                return None
    return None


def _get(d: dict[str, Any] | None, dotted: str):
    for key in dotted.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def upload_files(folder: Path) -> list[str]:
    """Only checkpoint files: config, weights, index, card and mask embedding when present."""
    files = ["config.json", CARD_FILE] + [p.name for p in weight_files(folder)]
    if (folder / INDEX_FILE).is_file():
        files.append(INDEX_FILE)
    files += [name for name in EXTRA_FILES if (folder / name).is_file()]
    return sorted(set(files))


def model_card(folder: Path, repo_id: str, license: str | None = None) -> str:
    from dflash_train.model.checkpoint import read_drafter_config

    module = formats.detect_format(folder)
    cfg = read_drafter_config(folder, mask_token_id=0)
    summary = find_summary(folder)
    base = cfg.verifier_name_or_path or _get(summary, "target") or "unknown"
    lic = license or _get(summary, "license") or "other"
    k = cfg.num_speculative_tokens
    aux = cfg.aux_hidden_state_layer_ids
    lines = ["---", f"base_model: {base}", f"license: {lic}", "library_name: vllm",
             "tags:", "- dflash", "- speculative-decoding", f"- {module.NAME}", "---", "",
             f"# {repo_id.split('/')[-1]}", "",
             f"A DFlash block-diffusion draft model for speculative decoding with `{base}` as the target.", "",
             "| field | value |", "|---|---|",
             f"| format | {module.NAME} |",
             f"| draft layers | {cfg.num_hidden_layers} (hidden {cfg.hidden_size}) |",
             f"| block size | {cfg.block_size} ({k} speculative tokens) |",
             f"| target layer ids (z-lab / SGLang) | {cfg.target_layer_ids} |",
             f"| aux_hidden_state_layer_ids (speculators / vLLM) | {aux} |",
             f"| mask_token_id | {cfg.mask_token_id} |",
             f"| draft vocab | {cfg.draft_vocab_size} of {cfg.vocab_size}"
             f"{' (reduced: d2t/t2d)' if cfg.reduced_vocab else ''} |",
             f"| dtype | {cfg.dtype} |"]
    data = _get(summary, "data_source") or _get(summary, "data")
    tau = _get(summary, "eval.tau")
    val = _get(summary, "val_acceptance_length") or _get(summary, "val_accept_len")
    if data is not None or tau is not None or val is not None:
        lines += ["", "## Training", ""]
        if data is not None:
            lines.append(f"- training data: {json.dumps(data) if not isinstance(data, str) else data}")
        if tau is not None:
            lines.append(f"- acceptance length τ (speculative decoding check): {tau}")
        if val is not None:
            lines.append(f"- validation block acceptance length: {val}")
    lines += ["", "## Serve with vLLM (>= 0.33)", ""]
    if module is formats.speculators:
        lines += ["The config is in the speculators format, which vLLM detects:", "", "```bash",
                  f"vllm serve {repo_id} --max-num-batched-tokens 32768", "```", "",
                  "or name the target explicitly:", ""]
    lines += ["```bash",
              f"vllm serve {base} --max-num-batched-tokens 32768 \\",
              f"  --speculative-config '{{\"method\": \"dflash\", \"model\": \"{repo_id}\", "
              f"\"num_speculative_tokens\": {k}}}'", "```", "", "## Serve with SGLang", ""]
    if cfg.reduced_vocab:
        lines += ["SGLang cannot serve a reduced-vocabulary drafter (it always uses the target's LM head). "
                  "`dflash-convert to-zlab --expand-vocab` rebuilds a full-vocabulary copy; it is exact on the "
                  "kept ids only when the draft lm_head equals the target's rows."]
    else:
        if module is not formats.zlab:
            lines += ["SGLang reads the z-lab layout: convert first with "
                      f"`dflash-convert to-zlab {repo_id.split('/')[-1]} OUT`, then:", ""]
        lines += ["```bash", f"python -m sglang.launch_server --model-path {base} \\",
                  "  --speculative-algorithm DFLASH --speculative-draft-model-path "
                  f"{repo_id if module is formats.zlab else 'OUT'} \\",
                  f"  --speculative-num-draft-tokens {cfg.block_size}", "```"]
    lines += ["", "Converted, validated and published with dflash-toolkit (`dflash-convert`).", ""]
    return "\n".join(lines)


def plan_push(folder: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
              license: str | None = None) -> PushPlan:
    """Validate, then list the files and build the card. Raises when validation fails."""
    from .validate import validate_folder

    folder = Path(folder)
    if "/" not in repo_id or repo_id.count("/") != 1:
        raise ConfigError(f"REPO_ID {repo_id!r}: expected ORG/NAME")
    report = validate_folder(folder)
    if not report.ok:
        first = report.failures()[0]
        raise CheckpointError(f"{folder}: validation failed ({len(report.failures())} checks), first: "
                              f"{first.check}: {first.reason}; run `dflash-convert validate {folder}`")
    notes = []
    card_path = folder / CARD_FILE
    if card_path.is_file():
        card = card_path.read_text()
        notes.append(f"using the existing {CARD_FILE} in {folder}")
    else:
        card = model_card(folder, repo_id, license)
    return PushPlan(folder, repo_id, upload_files(folder), card, revision, private, notes)


def check_token_env(token_env: str) -> None:
    """`--token-env` names a variable; a value that looks like a token itself is refused unseen."""
    # a hub token is `hf_` and mixed-case letters and digits; a variable name is not (HF_TOKEN, hf_token)
    looks_like_token = (token_env.startswith("hf_") and re.search(r"[A-Z0-9]", token_env[3:]) is not None) \
        or len(token_env) > 64
    if looks_like_token or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", token_env):
        raise ConfigError("--token-env takes the NAME of the environment variable that holds the token (e.g. "
                          "HF_TOKEN), not the token; the value given is not shown. Run `export HF_TOKEN=...` "
                          "and pass --token-env HF_TOKEN (or leave it out)")


def resolve_token(token_env: str = "HF_TOKEN") -> str:
    check_token_env(token_env)
    token = os.environ.get(token_env)
    if token:
        return token
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise ConfigError(f"no hub token: set ${token_env} (see --token-env) or run `hf auth login`")
    return token


def push(plan: PushPlan, *, token_env: str = "HF_TOKEN", endpoint: str | None = None) -> str:
    """create_repo + one commit of exactly `plan.files`. Returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint, token=resolve_token(token_env))
    try:
        return _commit(api, plan, CommitOperationAdd)
    except HfHubHTTPError as exc:  # the hub's message names the status and URL, never the token
        raise HubError(f"upload to {plan.repo_id} failed: {str(exc).splitlines()[0]}") from None
    except _network_errors() as exc:  # unreachable endpoint, offline mode, timeouts
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise HubError(f"upload to {plan.repo_id}: cannot reach the hub at {api.endpoint} ({type(exc).__name__}"
                       f"{': ' + reason if reason else ''}); check the network, HF_ENDPOINT and HF_HUB_OFFLINE, "
                       "then push again (nothing was uploaded unless the hub said so)") from None


def _network_errors() -> tuple[type[BaseException], ...]:
    """Transport failures of the HTTP client huggingface_hub uses (httpx, or its fork httpx2), and OSError."""
    import importlib

    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(name).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def _commit(api, plan: PushPlan, CommitOperationAdd) -> str:
    api.create_repo(plan.repo_id, private=plan.private, exist_ok=True, repo_type="model")
    if plan.revision and plan.revision != "main":
        api.create_branch(plan.repo_id, branch=plan.revision, exist_ok=True)
    ops = []
    for name in plan.files:
        if name == CARD_FILE:
            ops.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=plan.card.encode()))
        else:
            ops.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(plan.folder / name)))
    info = api.create_commit(plan.repo_id, ops, commit_message="Upload DFlash drafter (dflash-toolkit)",
                             revision=plan.revision)
    return str(getattr(info, "commit_url", "") or f"{api.endpoint}/{plan.repo_id}")
