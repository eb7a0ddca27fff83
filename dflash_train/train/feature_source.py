"""The documents a recipe trains on, and the offline feature cache they are read from.

`recipe_source` turns the recipe's objective (the kl loss's teacher top-k, over the drafter's own ids with
`objective.kl_teacher: draft_vocab`; greedy or dataset labels) into a `DocumentSource`. With
`data.features: offline`, `offline_cache` picks the cache folder under the data cache that holds what the run
needs, reusing any complete one that does (a kl run's cache serves a ce run), and writes one once if none does;
an interrupted write resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_train.errors import MissingDependencyError
from dflash_train.train.documents import DocumentSource, TrainingRows, data_cache_root
from dflash_train.train.recipe import DataConfig, TrainRecipe


def recipe_source(recipe: TrainRecipe, target_path: str, rows: TrainingRows, target_model, drafter) -> DocumentSource:
    """The documents `recipe` trains `drafter` on: the kl loss's teacher top-k (over the drafter's own ids with
    `objective.kl_teacher: draft_vocab` and a reduced vocabulary), from the offline cache (computed once, then
    reused) or computed in memory, as `data.features` says."""
    o, data = recipe.objective, recipe.data
    topk = o.kl_topk if o.loss == "kl" else None
    vocab = drafter.t2d.nonzero().squeeze(1).cpu() \
        if topk and o.kl_teacher == "draft_vocab" and drafter.config.reduced_vocab else None
    layers = drafter.config.target_layer_ids
    greedy = o.labels == "greedy" or ("prompts" if o.positions == "all" else False)  # the prompts' argmax alone
    cache = offline_cache(data, target_path, rows.path, layers, topk, greedy=greedy, topk_vocab=vocab,
                          model=target_model) if data.features == "offline" else None
    return DocumentSource(rows.rows, data.features, target_model, layers, cache, topk=topk,
                          target_hidden=target_model.config.get_text_config().hidden_size, topk_vocab=vocab)


def _manifest(path: Path) -> dict:
    """The feature cache's manifest at `path`, or {} where there is none (or it cannot be read)."""
    from dflash_train.features.cache import MANIFEST_FILE

    try:
        return json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}


def cache_complete(path: Path) -> bool:
    """Whether the feature cache folder at `path` holds a complete cache (its manifest says so)."""
    return bool(_manifest(path).get("complete"))


def _serves(manifest: dict, greedy: bool | str) -> bool:
    """Whether a feature cache with this manifest is complete and holds the greedy tokens `greedy` asks for."""
    from dflash_train.features.cache import serves_greedy

    return bool(manifest.get("complete")) and serves_greedy(manifest.get("greedy_next", True), greedy)


def _with_teacher(path: Path, layer_ids: list[int], compute: str, greedy: bool | str) -> Path | None:
    """A complete cache beside `path` of the same rows, layer ids and target dtype that a kl run wrote (with a
    top-k teacher) and that holds the greedy tokens `greedy` asks for: a run without a teacher reads it instead
    of writing a cache of its own (the teacher's log-probs are ~5% of a row's bytes, and left unread)."""
    for p in sorted(path.parent.glob(f"features-{'-'.join(map(str, layer_ids))}-top*")):
        m = _manifest(p)
        if m.get("target_dtype") == compute and m.get("target_layer_ids") == layer_ids and _serves(m, greedy):
            return p
    return None


def _reusable(model, compute: str, device: str):
    """`model` where it computes in `compute` on a `device` (the cache writer's dtype and device type), else None."""
    from dflash_train.target import dtype_name

    if model is None:
        return None
    weight = next(model.parameters())
    return model if dtype_name(weight.dtype) == compute and weight.device.type == device else None


def offline_cache(data: DataConfig, target_path: str, prepared: Path, layer_ids: list[int], topk: int | None = None,
                  greedy: bool | str = True, topk_vocab: torch.Tensor | None = None, model=None):
    """The data stage's FeatureCache for these rows and layer ids (written once if missing); with `topk` (the kl
    loss) its shards must hold at least k top-k log-probs per token, over the sorted target ids `topk_vocab` when
    given (a folder of its own per vocabulary). `greedy=False` (dataset labels): a cache with the greedy tokens is
    used when one is complete, else one is written without them (no LM head) into a folder of its own. A
    draft-vocabulary teacher's cache is named for the first labelling that wrote it; the others get `<name>-greedy`
    (greedy labels) or `<name>-prompts` (`greedy="prompts"`: dataset labels with the prompts' positions, the
    target's argmax there only), unless a complete one already holds what they need. `model`: the target the
    caller has loaded already; a cache that must be written is computed with it where it runs in the cache's dtype
    on this machine's device, instead of a second copy loaded beside it (an 8B target: ~16 GB more)."""
    try:
        from dflash_train.features.cache import FeatureCache, write_feature_cache
    except ImportError as exc:
        raise MissingDependencyError("data.features: offline needs dflash_train.features.cache (not installed in "
                                     "this checkout); use data.features: memory or online") from exc
    from dflash_train.features.extract import vocab_tag
    from dflash_train.target import dtype_name, target_torch_dtype

    device = "cuda" if torch.cuda.is_available() else "cpu"
    compute = dtype_name(target_torch_dtype(data.target_dtype, device))
    tag = vocab_tag(topk_vocab) if topk and topk_vocab is not None else None
    if data.feature_cache:
        path = Path(data.feature_cache)
    else:
        name = f"features-{'-'.join(map(str, layer_ids))}" + (f"-top{topk}-v{tag}" if tag else f"-top{topk}" if topk else "")
        if compute != ("bfloat16" if device == "cuda" else "float32"):
            name += f"-{compute}"  # not the device's plain dtype (names before `auto` read the CPU): its own cache
        path = data_cache_root(data, target_path) / name
        if not topk and not cache_complete(path):  # a kl run's cache holds these features and greedy tokens too
            path = _with_teacher(path, layer_ids, compute, bool(greedy)) or path
        lean = path.with_name(f"{name}-nogreedy")
        if not greedy and not topk and not cache_complete(path):
            path = lean  # a complete cache with greedy tokens serves dataset labels too; else a lean one
        written = _manifest(path)
        if not tag:
            greedy = bool(greedy)  # the plain folder holds every greedy token: the argmax at some is no cheaper
        elif greedy and written.get("complete") and not _serves(written, greedy):
            # written for other labels: the first complete one that serves these, else a folder of their own
            kinds = [path.with_name(f"{name}-greedy"), path.with_name(f"{name}-prompts")]
            path = next((p for p in kinds if _serves(_manifest(p), greedy)), kinds[greedy == "prompts"])
        if not cache_complete(path):  # missing, or left incomplete by an interrupted run: (re)write resumes it
            from dflash_train.output_lock import output_lock

            with output_lock(path, "the feature cache", "train", wait=True):  # another run may be writing it
                if not cache_complete(path):
                    # a teacher over the draft vocabulary runs the whole head only for greedy labels
                    write_feature_cache(target_path, prepared, path, target_layer_ids=layer_ids, topk=topk,
                                        target_dtype=compute, greedy=greedy or (path != lean and not tag),
                                        topk_vocab=topk_vocab, model=_reusable(model, compute, device))
    cache = FeatureCache(path, target=target_path, target_layer_ids=layer_ids, topk=topk,
                         target_dtype=compute if data.target_dtype != "auto" else None, greedy=greedy, topk_vocab=tag)
    cache.lengths()  # every shard opened and checked now: a damaged one is refused before the run folder is written
    return cache
