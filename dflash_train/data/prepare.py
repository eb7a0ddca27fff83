"""`dflash-train prepare`: conversations -> a tokenized, loss-masked `datasets` folder.

Output folder (written to a temp folder, then renamed; the output policy of dflash_train.outputs
decides whether an existing folder may be replaced):
- the `save_to_disk` dataset: `input_ids` (list[int]), `loss_mask` (list[int] 0/1), `messages`
  (JSON string of the normalised conversation);
- `token_freq.json`: counts of loss-masked tokens (for reduced draft vocabularies);
- `prepare_summary.json`: rows kept, rows dropped by reason, tokens, supervised tokens, the
  target path and the inputs. A rerun with the same inputs on a complete folder reuses it; a
  folder from other inputs is replaced only with `overwrite`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path

from dflash_train.errors import DataError
from dflash_train.outputs import folder_output, plan_output

SUMMARY_FILE = "prepare_summary.json"
REQUIRED_COLUMNS = ("input_ids", "loss_mask", "messages")


def warn_past_context(max_length: int, target_path: str) -> None:
    """--max-length above the target's context: rows past it would train on positions the target never
    saw (its features there mean nothing). Said once on stderr, naming the target's context."""
    import sys

    from dflash_train.target import load_target_config

    context = getattr(load_target_config(target_path).get_text_config(), "max_position_embeddings", None)
    if isinstance(context, int) and max_length > context:
        print(f"warning: --max-length {max_length} is above the target's context of {context} tokens "
              f"(max_position_embeddings of {target_path}); rows longer than {context} tokens would go past it. "
              f"Pass --max-length {context} or less", file=sys.stderr)


def prepare_dataset(target: str | None, source: str | Sequence[str], output: str | Path,
                    max_samples: int | None = None, max_length: int = 2048, split: str | None = None,
                    subset: str | None = None, max_turns: int | None = None, overwrite: bool = False,
                    label: str | None = None) -> dict:
    """Prepare one source, or several mixed (`max_samples` then applies to each; every row carries
    its source's label in a `source` column). `label` labels a single source's rows."""
    from dflash_train.data.sources import load_conversations
    from dflash_train.target import check_architecture, load_tokenizer, resolve_target

    many = not isinstance(source, (str, Path))
    names = [str(s) for s in source] if many else [str(source)]
    if not names:
        raise DataError("--data: name at least one dataset")
    labels = [default_label(n) for n in names] if many else ([label] if label else None)
    if labels and len(set(labels)) < len(labels):
        raise DataError(f"--data: two sources share the label {labels!r}; give datasets with distinct names")
    target_path = resolve_target(target)
    check_architecture(target_path)  # before any data work
    inputs = {"command": "prepare", "target": target_path,
              "source": [_source_id(n) for n in names] if many else _source_id(names[0]),
              "max_samples": max_samples, "max_length": max_length, "split": split, "subset": subset}
    if labels:
        inputs["labels"] = labels
    if max_turns is not None:
        if max_turns < 1:
            raise DataError(f"--max-turns must be >= 1, got {max_turns}")
        inputs["max_turns"] = max_turns
    cached = cached_summary(output, inputs)
    if cached is not None:  # this command's own output, complete: reused, nothing is written
        return cached
    sources = [*names, target]
    plan_output(output, "--output", sources=sources, overwrite=overwrite)
    warn_past_context(max_length, target_path)
    tokenizer = load_tokenizer(target_path)
    conversations, row_labels = [], []
    for i, name in enumerate(names):
        convs = load_conversations(name, split=split, subset=subset, max_samples=max_samples)
        conversations += convs
        row_labels += [labels[i]] * len(convs) if labels else []
    if max_turns is not None:
        conversations = [first_turns(c, max_turns) for c in conversations]
    summary = write_prepared(conversations, tokenizer, output, inputs, max_length=max_length, overwrite=overwrite,
                             sources=sources, labels=row_labels or None)
    warn_truncated(summary, max_length)
    return summary


def warn_truncated(summary: dict, max_length: int) -> None:
    """Rows cut at --max-length lose their ends (answers included): said once on stderr, with how much."""
    import sys

    if summary.get("rows_truncated"):
        print(f"warning: --max-length {max_length} cut {summary['rows_truncated']} of {summary['rows']} rows "
              f"({summary['tokens_truncated']:,} tokens in all, up to {summary['max_tokens_truncated']:,} from one "
              "row); what they lost is not trained on. Raise --max-length to keep more of them", file=sys.stderr)


def default_label(source: str) -> str:
    """A source's row label: the shipped name, a file's stem, a folder's or hub id's last part."""
    path = Path(source)
    return path.stem if path.suffix else str(source).rstrip("/").split("/")[-1]


def first_turns(messages: list[dict], max_turns: int) -> list[dict]:
    """The conversation up to and including its `max_turns`-th assistant turn.

    Regeneration is sequential in turns, so keeping one exchange per conversation is the cheap way
    to regenerate many different prompts.
    """
    out, seen = [], 0
    for m in messages:
        out.append(m)
        if m["role"] == "assistant":
            seen += 1
            if seen == max_turns:
                break
    return out


def write_prepared(conversations: Iterable[list[dict]], tokenizer, output: str | Path, inputs: dict,
                   max_length: int = 2048, thinking: bool | None = None, extra: dict | None = None,
                   overwrite: bool = False, sources=(), labels: Sequence[str | None] | None = None) -> dict:
    """Render, mask, count and save atomically; shared by prepare and regenerate.

    `labels` (one per conversation) become a `source` column. An existing `output` is replaced only
    when it is an earlier toolkit output and `overwrite`."""
    import datasets
    from tqdm import tqdm

    from dflash_train.data.render import ChatRenderer
    from dflash_train.data.vocab import TOKEN_FREQ_FILE, count_token_frequencies, write_token_freq

    renderer = ChatRenderer(tokenizer, max_length=max_length, thinking=thinking)
    conversations = list(conversations)
    if not conversations:
        raise DataError("the dataset is empty: no conversations to prepare")
    if labels is not None and len(labels) != len(conversations):
        raise ValueError(f"{len(labels)} source labels for {len(conversations)} conversations")
    rows = {"input_ids": [], "loss_mask": [], "messages": []}
    if labels is not None:
        rows["source"] = []
    dropped: Counter[str] = Counter()
    truncated, cut = 0, []
    for n, messages in enumerate(tqdm(conversations, desc="render", unit="conv", mininterval=1.0)):
        row = renderer.render(messages)
        if isinstance(row, str):
            dropped[row] += 1
            continue
        truncated += row.truncated
        cut += [row.tokens_cut] if row.tokens_cut else []
        rows["input_ids"].append(row.input_ids)
        rows["loss_mask"].append(row.loss_mask)
        rows["messages"].append(json.dumps(messages, ensure_ascii=False))
        if labels is not None:
            rows["source"].append(labels[n] or "")
    if not rows["input_ids"]:
        raise DataError(f"no usable conversation: all {len(conversations)} were dropped ({dict(dropped)}); "
                        "check that the data has assistant turns and that --max-length is large enough")
    vocab = max(len(tokenizer), max(max(r) for r in rows["input_ids"]) + 1)
    # one flat pair: counting row by row costs a vocab-sized bincount per row
    flat = (list(chain.from_iterable(rows["input_ids"])), list(chain.from_iterable(rows["loss_mask"])))
    counts = count_token_frequencies([flat], vocab)
    summary = {
        "rows": len(rows["input_ids"]),
        "rows_in": len(conversations),
        "rows_dropped": dict(dropped),
        "rows_truncated": truncated,
        "tokens_truncated": sum(cut), "max_tokens_truncated": max(cut, default=0),
        "tokens": sum(len(r) for r in rows["input_ids"]),
        "supervised_tokens": int(counts.sum()),
        "target": inputs.get("target"),
        "chat_template_path": "generation-markers" if renderer.markers else "rendered-prefixes",
        "thinking": thinking,
        "inputs": inputs,
        **(extra or {}),
    }
    if labels is not None:
        summary["rows_by_source"] = dict(sorted(Counter(rows["source"]).items()))
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "loss_mask": datasets.List(datasets.Value("int8")),
                                  "messages": datasets.Value("string"),
                                  **({"source": datasets.Value("string")} if labels is not None else {})})
    ds = datasets.Dataset.from_dict(rows, features=features)
    need = 5 * summary["tokens"] + sum(len(m) for m in rows["messages"]) + 8 * vocab
    with folder_output(output, "--output", str(inputs.get("command", "prepare")), sources=sources,
                       overwrite=overwrite, need_bytes=need) as tmp:
        ds.save_to_disk(str(tmp))
        write_token_freq(tmp / TOKEN_FREQ_FILE, counts)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


def combine_prepared(parts: Sequence[str | Path], output: str | Path, inputs: dict, overwrite: bool = True) -> dict:
    """Concatenate prepared folders (a mixture's sources, each labelled) into one, token counts summed.

    A rerun with the same `inputs` on a complete folder reuses it."""
    import datasets
    import torch

    from dflash_train.data.vocab import TOKEN_FREQ_FILE, read_token_freq, write_token_freq

    cached = cached_summary(output, inputs)
    if cached is not None:
        return cached
    sets = [load_prepared(p) for p in parts]
    unlabelled = [str(p) for p, ds in zip(parts, sets, strict=True) if "source" not in ds.column_names]
    if unlabelled:
        raise DataError(f"--data {unlabelled[0]}: rows carry no `source` label; prepare it with a label to mix it")
    counts = [read_token_freq(Path(p) / TOKEN_FREQ_FILE) for p in parts]
    vocab = max(len(c) for c in counts)
    total = sum(torch.nn.functional.pad(c, (0, vocab - len(c))) for c in counts)
    summaries = [read_summary(p) for p in parts]
    ds = datasets.concatenate_datasets([d.select_columns(["input_ids", "loss_mask", "messages", "source"])
                                        for d in sets])
    summary = {"rows": len(ds), "tokens": sum(int(s_.get("tokens", 0)) for s_ in summaries),
               "supervised_tokens": int(total.sum()),
               "rows_by_source": dict(sorted(Counter(ds["source"]).items())),
               "target": inputs.get("target"), "parts": [str(p) for p in parts], "inputs": inputs}
    with folder_output(output, "--output", str(inputs.get("command", "combine")), sources=list(parts),
                       overwrite=overwrite, need_bytes=5 * summary["tokens"] + 8 * vocab) as tmp:
        ds.save_to_disk(str(tmp))
        write_token_freq(tmp / TOKEN_FREQ_FILE, total)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


def cached_summary(output: str | Path, inputs: dict) -> dict | None:
    """The summary of a complete output folder written from the same inputs, else None."""
    path = Path(output) / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except ValueError:
        return None
    if summary.get("inputs") != json.loads(json.dumps(inputs)):
        return None
    if not (Path(output) / "dataset_info.json").is_file():
        return None
    return {**summary, "cached": True}


def _source_id(source: str) -> str:
    p = Path(source)
    if p.exists():
        st = p.stat()
        return f"{p.resolve()}@{st.st_size}:{int(st.st_mtime)}"
    return str(source)


def load_prepared(path: str | Path):
    """The prepared `datasets.Dataset` at `path`, with its columns checked."""
    import datasets

    path = Path(path)
    if not (path / "dataset_info.json").is_file() and not (path / "state.json").is_file():
        raise DataError(f"--data {path}: not a prepared dataset folder; run `dflash-train prepare --output {path}` first")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(f"--data {path}: cannot load the dataset ({exc}); rerun `dflash-train prepare`") from exc
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"--data {path}: holds several splits ({list(ds)}); give one split's folder")
    missing = [c for c in ("input_ids", "loss_mask") if c not in ds.column_names]
    if missing:
        raise DataError(f"--data {path}: missing column(s) {missing} (has {ds.column_names}); "
                        "rerun `dflash-train prepare`")
    if len(ds) == 0:
        raise DataError(f"--data {path}: the dataset is empty")
    return ds


def read_summary(path: str | Path) -> dict:
    p = Path(path) / SUMMARY_FILE
    return json.loads(p.read_text()) if p.is_file() else {}
