"""The training recipe: a typed schema, YAML loading, dotted overrides and provenance.

Precedence: `--set a.b=c` overrides (values parsed as YAML) > the recipe file > defaults. Unknown or mistyped
fields, and a key given twice, are errors naming the dotted path or the lines. The resolved config is written to the
run folder with, on every line, the layer that set the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash_train.errors import ConfigError
from dflash_train.model.config import MAX_BLOCK_SIZE
from dflash_train.train.recipe_yaml import load_yaml


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RegenerateConfig(_Section):
    enabled: bool = True
    max_new_tokens: int = Field(256, gt=0)
    temperature: float = Field(0.0, ge=0)
    thinking: bool | None = None
    engine: Literal["hf", "vllm", "auto"] = "hf"  # auto: vLLM where it runs (here or its venv), else hf
    batch_size: int | None = Field(None, gt=0)  # conversations per generate call; null: 256 on CPU, 16384 on CUDA
    # the dtype the target generates in; auto: bfloat16 on CUDA and on CPUs with bf16 instructions
    # (AVX512-BF16, AMX: ~1.4x faster than float32), float32 on the others (bf16 ran 5x slower there).
    # Greedy answers are the dtype's own (they part after the first near-tie): pair with the features'
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    def cache_inputs(self) -> dict:
        """The settings that decide the regenerated rows, as cache keys spell them (`dtype` only when
        not auto, so rows regenerated before the field existed keep their key)."""
        d = self.model_dump(mode="json")
        if d["dtype"] == "auto":
            del d["dtype"]
        return d


class SourceConfig(_Section):
    """One source of a data mixture (`data.source` as a list)."""

    source: str  # dataset name or path, as `data.source`
    max_samples: int | None = Field(None, gt=0)  # default: data.max_samples
    split: str | None = None
    subset: str | None = None
    label: str | None = None  # the rows' `source` label (eval reports tau per label); default: from `source`


class DataConfig(_Section):
    # dataset name or path for the data stage's prepare_dataset, or a list of sources to mix (each
    # prepared and regenerated once and cached on its own; the rows carry a `source` label)
    source: str | list[SourceConfig] | None = None
    prepared: str | None = None  # an already prepared folder (skips prepare and regenerate)
    max_samples: int | None = Field(None, gt=0)
    max_length: int = Field(2048, gt=1)
    max_turns: int | None = Field(None, gt=0)  # keep conversations up to their N-th assistant turn
    split: str | None = None
    subset: str | None = None
    regenerate: RegenerateConfig = RegenerateConfig(enabled=False)
    # online: target forward every step; memory: computed once, kept in RAM; offline: feature cache on disk
    features: Literal["online", "memory", "offline"] = "online"
    feature_cache: str | None = None  # an existing offline cache folder (features: offline)
    # the dtype the target computes features (and greedy labels) in; auto: bfloat16 on CUDA and on CPUs
    # with bf16 instructions (~2x faster there), float32 on the others. bf16 greedy tokens differ from
    # float32's at ~2% of positions, so pair it with objective.labels: dataset on data the target regenerated
    target_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    holdout_fraction: float = Field(0.05, ge=0, lt=1)
    # seeds the data, apart from the run's `seed`: which rows are held out, which data.train_fraction keeps,
    # the check's training rows, and regeneration's sampling (temperature > 0). Runs that differ in `seed`
    # alone share their data and are measured on the same held-out rows (their spread is the seed's own)
    seed: int = 0
    # train on this fraction of the training rows (the same rows in every source's proportion; the
    # held-out rows and every cache are unchanged, so runs on 1/4, 1/2 and all rows compare directly)
    train_fraction: float = Field(1.0, gt=0, le=1)
    cache_dir: str | None = None  # where prepared data is cached (default $DFLASH_CACHE/data)

    def source_names(self) -> list[str]:
        """The dataset names or paths of `source` (one, or each of a mixture's)."""
        if self.source is None:
            return []
        return [self.source] if isinstance(self.source, str) else [s.source for s in self.source]

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.source is None and self.prepared is None:
            raise ValueError("data: set `source` (a dataset to prepare) or `prepared` (a prepared folder)")
        if isinstance(self.source, list):
            if not self.source:
                raise ValueError("data.source: an empty list; name at least one source")
            labels = [source_label(s) for s in self.source]
            dup = sorted({x for x in labels if labels.count(x) > 1})
            if dup:
                raise ValueError(f"data.source: two sources share the label {dup[0]!r}; give each a distinct `label`")
        return self


def source_label(spec: SourceConfig) -> str:
    """A mixture source's row label: its `label`, else the shipped name / file stem / hub id."""
    from dflash_train.data.prepare import default_label

    return spec.label or default_label(spec.source)


class DrafterConfig(_Section):
    num_layers: int = Field(1, gt=0)
    block_size: int = Field(16, ge=2, le=MAX_BLOCK_SIZE)  # B: the drafter proposes B - 1 tokens a step
    mask_token_id: int | None = Field(None, ge=0)
    num_features: int = Field(5, gt=0)
    target_layer_ids: list[int] | None = None  # z-lab ids (aux - 1); default: z-lab's choice
    intermediate_size: int | None = Field(None, gt=0)
    # reduced draft vocabulary (formats.md §6): the N most frequent supervised ids of the rows trained on (never
    # the held-out answers it is measured on); SGLang cannot serve it
    draft_vocab_size: int | None = Field(None, gt=0)
    # the reduced vocabulary's head starts as the target's rows; train it (true) or keep it frozen
    # like the full-vocabulary head (false, the paper's convention; generalises better on little data)
    train_lm_head: bool = False
    # the mask slots' input: the target's row of mask_token_id (false), or a vector of the drafter's own started there
    # and trained (true), saved as mask_embedding.pt, which vLLM reads (SGLang always takes the target's row)
    train_mask_embedding: bool = False
    # start the draft layers from target decoder layer N (-1: the last), the final norm from the target's; null: random
    init_from_target_layer: int | None = None
    init_from: str | None = None  # start from a saved drafter folder
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # dtype of saved drafters


class AnchorDensity(_Section):
    """Blocks per document in proportion to its anchor candidates (its supervised positions), as serving
    spends its decode steps: ceil(fraction * candidates), at least `min`, at most `max`."""

    fraction: float = Field(gt=0, le=1)
    min: int = Field(1, gt=0)  # floor: a short answer still gets this many (or all it has)
    max: int | None = Field(None, gt=0)  # cap (null: none): bounds the blocks, so the step's cost, per document

    @model_validator(mode="after")
    def _ordered(self) -> AnchorDensity:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"anchor_density: max {self.max} is below min {self.min}; raise max or lower min")
        return self

    def as_tuple(self) -> tuple[float, int, int | None]:
        return self.fraction, self.min, self.max


class ObjectiveConfig(_Section):
    # ce: cross-entropy on the labels; kl: KL to the target's next-token distribution, kept as its top
    # `kl_topk` log-probs per token (computed with the features; offline caches need `features --topk`)
    loss: Literal["ce", "kl"] = "ce"
    kl_topk: int = Field(32, gt=0)  # k of the kl loss: ~6 bytes per token per k in RAM or in the cache
    # the top k over: target_vocab (the whole head, then the draft ids among them), or draft_vocab (a reduced
    # drafter vocabulary's ids only: its rows of the head, a twelfth of SmolLM2's for 4K ids, in a cache of its own)
    kl_teacher: Literal["target_vocab", "draft_vocab"] = "target_vocab"
    # the teacher's top-k log-probs divided by this before they are renormalised: below 1 sharpens it toward its
    # greedy token (ce on greedy labels is the limit), above 1 flattens it. The check (val/, fit/) keeps 1
    kl_temperature: float = Field(1.0, gt=0)
    labels: Literal["greedy", "dataset"] = "greedy"
    anchors_per_document: int = Field(512, gt=0)  # blocks sampled per document, resampled every epoch
    # instead of a count, a fraction of each document's candidates with a floor and a cap, e.g.
    # {fraction: 0.15, min: 4, max: 48}; null: anchors_per_document decides (when set, it is not used)
    anchor_density: AnchorDensity | None = None
    gamma: float | None = Field(None, gt=0)  # default: by block size (see anchors.gamma_for_block_size)
    # also scale slot k's weight by the drafter's own chance (no gradient) that slots 1..k-1 of its block are
    # right: what greedy verification needs to reach slot k. One more LM-head forward a step. The check's loss
    # (val/, fit/) stays the plain weighted loss, so it compares across settings. expected_length: instead by the
    # derivative of the block's expected accepted length, sum over j >= k of P(slots 1..j right) (D-PACE): a slot
    # also counts for the later slots it lets verification reach
    prefix_weighting: bool | Literal["expected_length"] = False
    # each probability in those products taken as (1 - a) p + a; null: 0 for true, 0.5 (D-PACE's) for expected_length
    prefix_smoothing: float | None = Field(None, ge=0, le=1)
    # a mixture's sources count alike in the loss: each block's slot weights times rows / (sources x rows of
    # its source), the weights the step's acceptance curve uses (documents.source_balance); false: by rows
    balance_sources: bool = False
    # blocks that repeat earlier text of their row (data/repeats.py: a looping answer, a list's stem) weigh this much
    # in the loss, the others 1. Below 1 spends the loss elsewhere: a one-layer drafter cannot copy (the demo: 0.5);
    # above 1 pushes a deeper one toward copying (4 did not teach two). The check (val/, fit/) weighs all alike
    repeat_weight: float = Field(1.0, gt=0)
    trained_slots: int | None = Field(None, ge=1)  # train slots 1..N alone: the last layer computes those; null: all
    # U(-x, x) times each feature layer's RMS added to the context features of training steps (EAGLE's noise; the
    # check reads them clean); 0: none
    feature_noise: float = Field(0.0, ge=0)
    # dropout on each draft layer's attention and MLP outputs in training steps (the check and engines read them whole)
    dropout: float = Field(0.0, ge=0, lt=1)
    # answers: the loss mask's; all: also the prompts' after the template prefix all rows share, always on the
    # target's greedy tokens (with labels: dataset the answers keep the dataset's, and an offline cache computes the
    # target's whole head at the prompts' positions only; docs/training.md). The check (val/, fit/) stays on answers
    positions: Literal["answers", "all"] = "answers"
    # auto: compiled flex attention on a CUDA GPU, split on CPU; flex needs CUDA; dense is the reference
    attention: Literal["auto", "split", "dense", "flex"] = "auto"
    # positions per LM-head chunk; auto: 1024 on CPU, by vocabulary size on a GPU (train/loss.py)
    logits_chunk: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    # the head's per-chunk softmax, loss and argmax; auto: fused compiled kernels on a CUDA GPU, eager on
    # CPU (train/head_epilogue.py); compiled also runs on CPU (Inductor's C++ kernels)
    head: Literal["auto", "eager", "compiled"] = "auto"
    # the draft layers' RMSNorm, SwiGLU and RoPE; auto: fused compiled kernels on a CUDA GPU below ZeRO-3, else eager
    layer_kernels: Literal["auto", "eager", "compiled"] = "auto"
    # the training forward and its backward as one compiled graph over micro-batches of changing sizes
    # (train/compiled_step.py); auto: compiled where measured faster (bf16-mixed on CPUs with AMX, runs of 1,000+
    # steps, which pay for its compiles), eager otherwise
    training_forward: Literal["auto", "eager", "compiled"] = "auto"

    @model_validator(mode="after")
    def _smoothing_needs_weighting(self) -> ObjectiveConfig:
        if self.prefix_smoothing is not None and not self.prefix_weighting:
            raise ValueError("objective.prefix_smoothing is set but objective.prefix_weighting is false: it smooths "
                             "the weighting's probabilities; set prefix_weighting (true or expected_length) or drop it")
        return self


class OptimConfig(_Section):
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # which weights decay: matrices (the linear layers' and the head's weights; not the norms' gains or biases,
    # the convention of GPT-2/nanoGPT and transformers' Trainer), or all of them
    weight_decay_on: Literal["matrices", "all"] = "matrices"
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)
    # adamw: every weight; muon: the draft layers' projections and fc step with Muon (orthogonalised momentum,
    # its update scaled to AdamW's RMS so `lr` serves both), the LM head and the norms with AdamW
    # (train/optimizer.DeviceMuon; needs engine.zero_stage 0 and engine.optimizer torch)
    algorithm: Literal["adamw", "muon"] = "adamw"
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_ns_steps: int = Field(5, ge=1)  # Newton-Schulz iterations a step
    # orthogonalise every this many steps, that update applied until the next (the momentum takes every gradient)
    muon_every: int = Field(1, ge=1)
    # normuon: each orthogonalised update divided, neuron by neuron, by the root of a running mean of its squares
    # (NorMuon, arXiv 2510.05491; its norm kept), so no neuron's step stays larger than the others' for long
    muon_variant: Literal["muon", "normuon"] = "muon"
    # Muon's update's RMS as a multiple of AdamW's at the same lr (1: torch.optim.Muon's `match_rms_adamw`)
    muon_lr_scale: float = Field(1.0, gt=0)
    # which matrices Muon steps (the rest keep AdamW): the layers' attention (q/k/v/o) and MLP (gate/up/down)
    # projections, and fc; a group's iteration costs about its matrices' size (`bench_train_step.py --optimizer`)
    muon_on: list[Literal["attention", "mlp", "fc"]] = Field(default_factory=lambda: ["attention", "mlp", "fc"],
                                                           min_length=1)
    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, gt=0)


class BatchConfig(_Section):
    tokens_per_microbatch: int = Field(4096, gt=1)  # one packed row of documents
    grad_accum: int = Field(1, gt=0)


class EngineConfig(_Section):
    zero_stage: Literal[0, 1, 2, 3] = 0
    # bf16: DeepSpeed's bf16 (bf16 weights and activations, fp32 master weights in the optimizer);
    # bf16-mixed: fp32 weights and optimizer, the forward under torch.autocast(bf16) (matmuls and
    # attention in bf16, norms, residuals and the loss in fp32); auto: bf16 on GPU, bf16-mixed on CPUs with
    # bf16 instructions, fp32 on the others (resolved when the run starts; the resolved config says why)
    precision: Literal["auto", "fp32", "bf16", "bf16-mixed"] = "auto"
    optimizer: Literal["torch", "deepspeed"] = "torch"  # torch: AdamW as DeepSpeed's client optimizer
    num_gpus: int = Field(1, gt=0)  # documentation for the launch command; the launcher sets the world
    # keep only each draft layer's input and recompute the layer in the backward: less activation
    # memory (a micro-batch with many anchors fits), ~1/3 more layer compute; same gradients
    activation_checkpointing: bool = False
    # build step s + 1's micro-batches in a background thread while step s runs; auto: on a GPU only (on a CPU
    # the thread and the step share the cores: the demo's step 1.20x slower with it on 2 cores)
    prefetch: Literal["auto"] | bool = "auto"


class CheckpointConfig(_Section):
    save_every: int = Field(500, gt=0)
    keep_last: int = Field(3, gt=0)


class LoggingConfig(_Section):
    log_every: int = Field(10, gt=0)
    eval_every: int = Field(200, gt=0)
    eval_documents: int = Field(64, gt=0)  # held-out documents of the periodic check (a block at every position;
    # a mixture's sources take turns)
    # training documents the check also measures the same way (`fit/` in TensorBoard), so held-out acceptance
    # has a like-for-like training number (the step's own `train/` numbers come from its sampled blocks, weighted
    # to stand for every position, on the rows it is training on). null: as many as eval_documents; 0: off
    fit_documents: int | None = Field(None, ge=0)
    progress: bool = True
    # steps run under torch.profiler (0: none), from `profile_from` steps after the run (re)starts, past the
    # compiles: OUT/profile.json (device busy share, ms a step per kernel class, the heaviest kernels) and the
    # trace beside it (train/profiling.py)
    profile_steps: int = Field(0, ge=0)
    profile_from: int = Field(20, ge=0)


class EvalConfig(_Section):
    enabled: bool = False
    max_prompts: int = Field(20, gt=0)
    max_new_tokens: int = Field(128, gt=0)
    # also decode each prompt plainly, one at a time, for `speedup` (transformers' batch-1 wall clock, not a server's);
    # off: the prompts verified as one batch, lossless against the target's argmax (8 demo prompts 29.5 s, not 100.5)
    measure_speedup: bool = False


class TrainRecipe(_Section):
    target: str | None = None  # HF folder or hub id; None: the embedded SmolLM2-135M-Instruct
    seed: int = 0
    data: DataConfig
    drafter: DrafterConfig = DrafterConfig()
    objective: ObjectiveConfig = ObjectiveConfig()
    optim: OptimConfig = OptimConfig()
    batch: BatchConfig = BatchConfig()
    engine: EngineConfig = EngineConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()

    @model_validator(mode="after")
    def _zero3_head(self):
        # the fused LM head reads its weight outside a module call; ZeRO-3 gathers a frozen head for it
        # (train/batches.full_head_weight), but a trained head's gradient would miss its partitions
        if self.engine.zero_stage == 3 and self.drafter.train_mask_embedding:
            raise ValueError("drafter.train_mask_embedding: the mask embedding cannot be trained under "
                             "engine.zero_stage 3; set engine.zero_stage 2 (or 0/1), or train_mask_embedding: false")
        if self.engine.zero_stage == 3 and self.drafter.train_lm_head and self.drafter.draft_vocab_size:
            raise ValueError("drafter.train_lm_head: a trained reduced-vocabulary head cannot run under "
                             "engine.zero_stage 3; set engine.zero_stage 2 (or 0/1), or train_lm_head: false")
        if self.optim.algorithm == "muon" and (self.engine.zero_stage != 0 or self.engine.optimizer != "torch"):
            raise ValueError("optim.algorithm: muon runs as the toolkit's own optimizer step: set engine.zero_stage: 0 "
                             "and engine.optimizer: torch, or use optim.algorithm: adamw")
        if self.objective.loss == "kl" and self.objective.kl_teacher == "draft_vocab" and not self.drafter.draft_vocab_size:
            raise ValueError("objective.kl_teacher: draft_vocab needs a reduced vocabulary (drafter.draft_vocab_size); "
                             "set one, or kl_teacher: target_vocab")
        return self


# fields that define what is trained: a run folder can only be resumed with the same values
RUN_IDENTITY = ("target", "seed", "data", "drafter", "objective", "batch")


def _format_errors(exc: ValidationError, where: str) -> str:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown field (check its spelling against `dflash-train train --help`)")
        else:
            lines.append(f"{path}: {err['msg']} (got {err.get('input')!r})")
    return f"{where}: " + "; ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value with a dotted key, e.g. --set optim.lr=1e-4")
    key, raw = item.split("=", 1)
    try:
        value = load_yaml(raw) if raw != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {item!r}: value is not valid YAML ({exc})") from exc
    if isinstance(value, str) and _looks_numeric(value):
        value = float(value)  # YAML 1.1 reads "1e-4" as a string
    return key.strip().split("."), value


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _set_dotted(tree: dict, keys: list[str], value: Any, flag: str) -> None:
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {flag}: `{k}` is a value, not a section")
        node = child
    node[keys[-1]] = value


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


class ResolvedRecipe:
    """A validated recipe plus the layer (default / recipe file / --set) of every field."""

    def __init__(self, recipe: TrainRecipe, sources: dict[str, str]):
        self.recipe = recipe
        self.sources = sources

    def to_yaml(self) -> str:
        """YAML of the resolved config; every leaf line ends with `# <layer>`."""
        return "".join(_emit(self.recipe.model_dump(mode="json"), self.sources, "", 0))


def _emit(tree: dict, sources: dict[str, str], prefix: str, indent: int):
    pad = "  " * indent
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield f"{pad}{key}:\n"
            yield from _emit(value, sources, path + ".", indent + 1)
        else:
            text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
            if text.endswith("\n...") or text.endswith("..."):
                text = text.replace("\n...", "").removesuffix("...").strip()
            yield f"{pad}{key}: {text}  # {sources.get(path, 'default')}\n"


def load_recipe(path: str | Path | None, overrides: list[str] | None = None,
                base: dict | None = None) -> ResolvedRecipe:
    """Read a recipe YAML (or `base`), apply `key=value` overrides, validate."""
    tree: dict = {}
    where = "recipe"
    if path is not None:
        path = Path(path)
        where = str(path)
        try:
            loaded = load_yaml(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"--config {path}: file not found") from exc
        except IsADirectoryError:
            raise ConfigError(f"--config {path}: is a folder; give a recipe YAML file (see recipes/)") from None
        except OSError as exc:
            raise ConfigError(f"--config {path}: cannot read it ({exc.strerror}); check its permissions") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--config {path}: not UTF-8 text; a recipe is a YAML file (see recipes/)") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a recipe is a mapping of sections (data:, drafter:, ...)")
        tree = loaded or {}
    elif base is not None:
        tree = base
    sources = {k: "recipe" for k in _leaves(tree)}
    for item in overrides or []:
        keys, value = parse_override(item)
        _set_dotted(tree, keys, value, item)
        for k in list(sources):
            if k == ".".join(keys) or k.startswith(".".join(keys) + "."):
                del sources[k]
        for k in _leaves({".".join(keys): value}) if not isinstance(value, dict) else _leaves(value, ".".join(keys) + "."):
            sources[k] = "--set"
    try:
        recipe = TrainRecipe.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, where)) from None
    return ResolvedRecipe(recipe, sources)
