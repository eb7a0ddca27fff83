"""Checkpoint formats, registered by name. CLI choices and detection come from FORMATS."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from dflash_train.errors import CheckpointError

from . import speculators, zlab
from .schema import require_object

FORMATS: dict[str, ModuleType] = {speculators.NAME: speculators, zlab.NAME: zlab}


def read_config_json(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json; not a drafter checkpoint folder")
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc.reason}); restore it or convert the drafter again") from exc
    require_object(raw, str(path))
    return raw


def detect_format(folder: Path) -> ModuleType:
    """The format module whose detector accepts `folder/config.json`."""
    config = read_config_json(folder)
    for module in FORMATS.values():
        if module.detect(config):
            return module
    raise CheckpointError(
        f"{folder}/config.json: not a DFlash drafter (found model_type={config.get('model_type')!r}, "
        f"architectures={config.get('architectures')}); expected a speculators config with "
        "`speculators_config` or a z-lab config with `dflash_config`"
    )
