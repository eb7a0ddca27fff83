"""What the user pointed `dflash-serve` at: a drafter folder, a hub id, or a training run.

Only convert's format detection is used here (style: serve_shim depends on convert's registry
alone). A training run resolves to its newest complete checkpoint: `RUN/final/`, else the
highest `RUN/checkpoints/step-N/` that holds a config.json and weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from convert.rules import RULES
from dflash_train.errors import CheckpointError, DFlashError
from dflash_train.model.checks import Fail, check_drafter, refusal
from dflash_train.model.config import DFlashConfig
from dflash_train.model.formats import detect_format, read_config_json
from dflash_train.model.locate import newest_run_checkpoint
from dflash_train.model.weights import weight_files

# loader rules the launch itself settles: the verifier is --target or the drafter's, judged with its own advice
SERVE_DECIDES = ("spec_verifier",)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
EXPECTED = ("a speculators DFlash folder (config.json with `speculators_config`), a z-lab DFlash folder "
            "(config.json with `dflash_config`), a hub id of either, or a training run folder "
            "(RUN/final/ or RUN/checkpoints/step-N/ with config.json and model.safetensors)")


class Drafter(BaseModel):
    """A detected drafter: where it lives, its format and its config."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    location: str  # a local folder (absolute) or a hub id, as the engine should be given it
    is_hub_id: bool
    format: str  # a key of dflash_train.model.formats.FORMATS
    config: DFlashConfig
    found: str  # how it was found, for messages and --dry-run

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def verifier(self) -> str | None:
        return self.config.verifier_name_or_path


def is_hub_id(text: str) -> bool:
    """`ORG/NAME` that is not an existing local path."""
    return bool(HUB_ID.match(text)) and not Path(text).exists()


def _describe(folder: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f"found [{shown}]" if names else "the folder is empty"


def _from_folder(folder: Path, found: str, target: str | None) -> Drafter:
    module = detect_format(folder)  # raises CheckpointError naming what config.json holds
    weight_files(folder)  # a drafter without weights cannot be served
    raw = read_config_json(folder)
    config = module.from_config_dict(raw, str(folder / "config.json"))
    # validate's checks (whole, shaped, finite), and against the target the engine will load: --target, else the
    # drafter's verifier, wherever either is found without a network
    check_drafter(folder, config, what="CHECKPOINT", target=target or config.verifier_name_or_path)
    for rule in RULES[module.NAME]:  # the loader rules `validate` applies: what the engine would refuse
        if rule.__name__ in SERVE_DECIDES:
            continue
        outcome = rule(raw)
        if isinstance(outcome, Fail):
            raise refusal(folder, "CHECKPOINT", f"config.json: {outcome.reason}")
    return Drafter(location=str(folder.resolve()), is_hub_id=False, format=module.NAME, config=config, found=found)


def fetch_hub_config(repo_id: str) -> Path:
    """Download (or find in the HF cache) `config.json` of a hub repo; returns its folder."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, "config.json")).parent
    except Exception as exc:  # huggingface_hub raises many types: offline, 404, gated, ...
        raise CheckpointError(f"CHECKPOINT {repo_id}: not a local folder, and its config.json could not be "
                              f"fetched from the hub ({type(exc).__name__}: {exc}); expected {EXPECTED}") from exc


def detect_drafter(checkpoint: str, fetch_config: Callable[[str], Path] = fetch_hub_config,
                   target: str | None = None) -> Drafter:
    """Detect what CHECKPOINT is; refuse anything that is not a servable DFlash drafter. A local
    folder gets `validate`'s structural checks, and the target's where `target` is found locally."""
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return _from_folder(path, f"{format_name(path)} drafter folder {path}", target)
        newest = newest_run_checkpoint(path)
        if newest is not None:
            return _from_folder(newest, f"training run {path}: newest complete checkpoint {newest}", target)
        raise CheckpointError(f"CHECKPOINT {path}: no config.json and no complete checkpoint "
                              f"({_describe(path)}); expected {EXPECTED}")
    if path.exists():
        raise CheckpointError(f"CHECKPOINT {path}: is a file, not a folder; expected {EXPECTED}")
    if not is_hub_id(checkpoint):
        raise CheckpointError(f"CHECKPOINT {checkpoint}: no such folder and not a hub id (ORG/NAME); "
                              f"expected {EXPECTED}")
    folder = fetch_config(checkpoint)
    config_dict = read_config_json(folder)
    module = detect_format(folder)
    config = module.from_config_dict(config_dict, f"{checkpoint}/config.json")
    return Drafter(location=checkpoint, is_hub_id=True, format=module.NAME, config=config,
                   found=f"{module.NAME} drafter on the hub {checkpoint}")


def format_name(folder: Path) -> str:
    try:
        return detect_format(folder).NAME
    except DFlashError:
        return "unknown"
