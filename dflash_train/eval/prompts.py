"""Evaluation prompts: a JSONL file of `prompt` / `messages` rows, or any source `prepare` reads.

A prompt is the conversation up to (not including) its first assistant turn, rendered with the
target's chat template and the generation prompt, so the target answers the first user turn.
A prompt may carry a source label (a JSONL row's `source`, a prepared row's `source` column), so
the eval can report acceptance per source.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.data.sources import read_text_file
from dflash_train.errors import DataError


def user_turns(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant turn (system and user turns)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append({"role": m.get("role"), "content": m.get("content")})
    return out


def _jsonl_row(row, path: Path, line: int) -> list[dict]:
    if not isinstance(row, dict):
        raise DataError(f"--prompts {path}: line {line} is a {type(row).__name__}; expected an object with "
                        "`prompt` (text) or `messages` (list of {role, content})")
    if isinstance(row.get("messages"), list):
        for m in row["messages"]:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DataError(f"--prompts {path}: line {line}: every message needs `role` and `content`")
        return list(row["messages"])
    if isinstance(row.get("prompt"), str):
        msgs = [{"role": "user", "content": row["prompt"]}]
        if isinstance(row.get("system"), str) and row["system"]:
            msgs.insert(0, {"role": "system", "content": row["system"]})
        return msgs
    raise DataError(f"--prompts {path}: line {line} has keys {sorted(row)}; expected `prompt` (text) or "
                    "`messages` (list of {role, content})")


def read_prompt_jsonl(path: str | Path) -> list[list[dict]]:
    return [messages for messages, _ in _labelled_jsonl(Path(path))]


def _label(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _labelled_jsonl(path: Path) -> list[tuple[list[dict], str | None]]:
    out = []
    for n, line in enumerate(read_text_file(path, "--prompts").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"--prompts {path}: line {n} is not valid JSON ({exc.msg})") from exc
        out.append((_jsonl_row(row, path, n), _label(row.get("source"))))
    return out


HOLDOUT_FILE = "holdout_rows.json"


def heldout_prompts(holdout_file: str | Path, max_prompts: int | None = None) -> list[list[dict]]:
    """User turns of a training run's held-out rows (`RUN/holdout_rows.json`): never training rows."""
    return [messages for messages, _ in _labelled_heldout(holdout_file, max_prompts)]


def read_holdout(path: Path, flag: str):
    """(the prepared dataset, its held-out row ids) of a run's `holdout_rows.json`; a mixture's sources
    take turns, so the first N rows cover each about equally. `flag` names the option in errors."""
    from dflash_train.data.prepare import load_prepared
    from dflash_train.train.documents import interleave_by_label

    try:
        holdout = json.loads(path.read_text())
        data, rows = holdout["data"], holdout["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{flag} {path}: not a training run's {HOLDOUT_FILE} (needs `data` and `rows`): {exc}") from exc
    if not rows:
        raise DataError(f"{flag} {path}: the run held out no rows; train with data.holdout_fraction > 0")
    ds = load_prepared(data)
    if "source" in ds.column_names:
        rows = interleave_by_label(rows, [ds[i]["source"] for i in rows])
    return ds, rows


def _labelled_heldout(holdout_file: str | Path, max_prompts: int | None) -> list[tuple[list[dict], str | None]]:
    ds, rows = read_holdout(Path(holdout_file), "--prompts")
    labelled = "source" in ds.column_names
    return [(user_turns(json.loads(ds[i]["messages"])), _label(ds[i]["source"]) if labelled else None)
            for i in rows[:max_prompts]]


def load_prompts(source: str, split: str | None = None, subset: str | None = None,
                 max_samples: int | None = None) -> list[list[dict]]:
    """Prompt conversations (user turns only) from a JSONL file, a `prepare` data source, or a
    training run folder / its `holdout_rows.json` (the rows held out of training)."""
    return [messages for messages, _ in load_labelled_prompts(source, split, subset, max_samples)]


def load_labelled_prompts(source: str, split: str | None = None, subset: str | None = None,
                          max_samples: int | None = None) -> list[tuple[list[dict], str | None]]:
    """`load_prompts` with each prompt's source label (None where the data names none)."""
    if max_samples is not None and max_samples < 1:
        raise DataError(f"--num-prompts must be >= 1, got {max_samples}")
    path = Path(source)
    if path.is_dir() and (path / HOLDOUT_FILE).is_file():
        path = path / HOLDOUT_FILE  # a training run folder: its held-out prompts
    if path.name == HOLDOUT_FILE and path.is_file():
        conversations = _labelled_heldout(path, max_samples)
    elif path.is_file() and path.suffix == ".jsonl" and _is_prompt_jsonl(path):
        conversations = _labelled_jsonl(path)
        if max_samples is not None:
            conversations = conversations[:max_samples]
    else:
        from dflash_train.data.sources import load_conversations

        conversations = [(conv, None) for conv in load_conversations(source, split, subset, None)]
    prompts = []
    for conv, label in conversations:
        turns = user_turns(conv)
        if any(m["role"] == "user" for m in turns):
            prompts.append((turns, label))
        if max_samples is not None and len(prompts) >= max_samples:
            break
    if not prompts:
        raise DataError(f"--prompts {source}: no conversation has a user turn before its first assistant turn")
    return prompts


def _is_prompt_jsonl(path: Path) -> bool:
    """A JSONL whose first row has `prompt` or `messages` (other schemas go to the data sources)."""
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        return True  # let the prompt reader name the bad line
                    return isinstance(row, dict) and ("messages" in row or "prompt" in row)
    except UnicodeDecodeError:
        return True  # the prompt reader names the file
    return True


def render_prompts(tokenizer, prompts: list[list[dict]]) -> list[list[int]]:
    """Token ids of each prompt's user turns plus the target's generation prompt."""
    from dflash_train.data.render import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    out = []
    for i, messages in enumerate(prompts):
        turns = user_turns(messages)
        if not turns:
            raise DataError(f"prompt {i}: no user turn before the first assistant turn")
        ids = renderer.prompt_ids(turns)
        if not ids:
            raise DataError(f"prompt {i}: renders to no tokens")
        out.append(ids)
    return out
