"""`dflash-train`: data preparation, feature extraction, training and evaluation of drafters.

Only this module reads argv and prints for humans; heavy imports happen inside commands so
`--help` is instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from dflash_train.errors import run_cli

app = typer.Typer(help="Train DFlash drafters for a target model.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)

TARGET_HELP = "Target model: HF folder or hub id (default: the embedded SmolLM2-135M-Instruct)."


@app.command("target-info")
def target_info(target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
                num_features: int = typer.Option(5, help="Number of target layers the drafter reads."),
                json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Locate (and on first use convert) the target; print its path, shape and default layer ids."""
    import json

    from dflash_train.features.layer_ids import default_target_layer_ids, target_to_aux
    from dflash_train.features.target import resolve_target

    path = resolve_target(target)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path).get_text_config()
    ids = default_target_layer_ids(cfg.num_hidden_layers, num_features)
    info = {"path": path, "model_type": cfg.model_type, "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "target_layer_ids": ids, "aux_hidden_state_layer_ids": target_to_aux(ids)}
    if json_out:
        typer.echo(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            typer.echo(f"{k:28s} {v}")


@app.command("init-drafter")
def init_drafter(output: Path = typer.Option(..., "--output", help="Folder to write the drafter to."),
                 target: Optional[str] = typer.Option(None, "--target", help=TARGET_HELP),
                 num_layers: int = typer.Option(1, help="Draft decoder layers."),
                 block_size: int = typer.Option(8, help="Block size B (B-1 speculative tokens)."),
                 mask_token_id: Optional[int] = typer.Option(None, help="Mask token id (default: by target)."),
                 num_features: int = typer.Option(5, help="Number of target layers the drafter reads."),
                 seed: int = typer.Option(0, help="Initialisation seed.")) -> None:
    """Write a freshly initialised drafter for the target in the speculators format."""
    from dflash_train.model.init import new_drafter_for_target
    from dflash_train.model.checkpoint import save_drafter

    model = new_drafter_for_target(target, num_layers=num_layers, block_size=block_size,
                                   mask_token_id=mask_token_id, num_features=num_features, seed=seed)
    save_drafter(model, output)
    typer.echo(f"wrote {output}")


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
