"""HF `generate` for `regenerate --engine hf`: length-sorted groups, and on CUDA a static KV cache with
a compiled decode step in groups sized to the GPU's free memory.

The prompts of one call are sorted by length (longest first) and cut into groups; each group is one
`generate` call with left padding, and its rows are handed back as soon as it returns, so the caller
can write finished rows at once (`generate_groups`).

CPU (what regeneration always did): dynamic KV cache, eager, groups of at most 32 rows padded to their
longest prompt. Every row of a group runs until the group's longest answer ends, so large groups slow
a CPU down (SmolLM2 on 2 cores: 32 rows give 72 tokens/s, 96 rows 45).

CUDA:
- a transformers `StaticCache` is passed to `generate`, which then runs every decode step through
  `torch.compile` (transformers' default `CompileConfig`: inductor, mode "reduce-overhead", i.e. CUDA
  graphs); the prefill stays eager. The last cache is kept and reset when the next group has the same
  shape, so its captured graphs stay valid. Attention is `data/gqa_decode.py`'s: a decode step reads
  each cached K/V head once, where transformers' compiled SDPA path with a mask would repeat them.
- one shape and one cache per width, for the whole run: a group's width (its padded prompt length) is
  rounded up to a ladder of two steps per octave (64, 96, 128, 192, 256, 384, ...), its cache holds
  width + max_new_tokens positions, and every group of a width has the same row count (a group that is
  not full is padded by repeating its first prompt; those results are dropped). The compiled decode
  step is captured as a CUDA graph over its cache's addresses, so a new cache for a shape seen before
  would capture another graph (and keep another pool); each width's cache is therefore kept and
  reset, never remade. Given the longest prompt (`max_prompt_length`, the data's max_length), the row
  count is the same for every width of the ladder up to it and sized so that all their caches fit
  together (`fixed_rows`); the planner counts the padded rows (`plan_groups(pad_rows=True)`). Without
  it, rows come from `rows_that_fit` per width and only the last cache is kept.
- which widths share a group: every decode step of a static cache reads all its positions, so short
  prompts in a wide group cost KV reads, while another group costs its own decode steps. The prompts'
  widths are split into runs (`plan_groups`, exact over the ladder's few widths) minimizing, per step,
      sum over groups of STEP_BYTES + weight bytes  +  sum over rows of (run width + max_new_tokens) * kv_bytes_per_token
  STEP_BYTES (4 GB: ~1.2 ms of an H100's bandwidth) stands for a compiled step's fixed cost beyond
  reading the weights (kernel launches of a ~30-layer model). It is an estimate, not a measurement:
  calibrate it with bench/bench_gpu_data.py.
- rows per group, from the model config and the free memory measured after loading the model:
      rows(width) = floor(SAFETY * free_bytes / bytes_per_row(width))
      bytes_per_row = kv_bytes_per_token * (width + max_new_tokens)          the static KV cache
                    + width * (3 * intermediate + 6 * hidden) * dtype bytes   prefill activations of one layer
                    + width * (width + max_new_tokens) * 2                    the prefill's attention mask
      kv_bytes_per_token = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes
  capped at MAX_ROWS_CUDA and rounded down to a multiple of 16. SAFETY = 0.6 leaves room for the
  allocator's fragmentation, the last-token logits and the CUDA graph pools. A group that still runs
  out of memory is split in two and retried, and later groups of that width or wider are capped at
  the smaller size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from dflash_train.errors import DataError

SAFETY = 0.6
MAX_ROWS_CPU = 32
MAX_ROWS_CUDA = 1024
MIN_ROWS_CUDA = 16
STEP_BYTES = 4 * 10**9


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of K and V one token takes in the KV cache of every layer (from an HF model config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * dtype_bytes


def ladder_width(n: int) -> int:
    """`n` rounded up to 64, 96, 128, 192, 256, 384, ... (two steps per octave)."""
    w = 64
    while w < n:
        w = w * 3 // 2 if w & (w - 1) == 0 else w * 4 // 3
    return w


def bytes_per_row(config, dtype_bytes: int, width: int, max_new_tokens: int) -> int:
    """GPU memory one row of a group needs: its static KV cache plus its share of the prefill (see above)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    length = width + max_new_tokens
    return (kv_bytes_per_token(config, dtype_bytes) * length + width * (3 * inter + 6 * hidden) * dtype_bytes
            + width * length * 2)


def rows_that_fit(free_bytes: int, row_bytes: int, safety: float = SAFETY, cap: int = MAX_ROWS_CUDA) -> int:
    """Rows of one group: floor(safety * free / row_bytes), at most `cap`, a multiple of 16 when >= 16, >= 1."""
    rows = min(cap, int(safety * free_bytes // row_bytes))
    return max(1, rows - rows % MIN_ROWS_CUDA if rows >= MIN_ROWS_CUDA else rows)


def ladder_up_to(n: int) -> list[int]:
    """Every ladder width up to ladder_width(n)."""
    widths = [64]
    while widths[-1] < n:
        widths.append(ladder_width(widths[-1] + 1))
    return widths


def fixed_rows(config, dtype_bytes: int, widths: list[int], max_new_tokens: int, free_bytes: int,
               cap: int = MAX_ROWS_CUDA) -> int:
    """One row count for every width in `widths` such that a static cache of each (all kept for the run)
    plus the prefill of one group of the widest fit in SAFETY * free_bytes (`rows_that_fit`)."""
    kv = kv_bytes_per_token(config, dtype_bytes)
    widest = max(widths)
    prefill = bytes_per_row(config, dtype_bytes, widest, max_new_tokens) - kv * (widest + max_new_tokens)
    return rows_that_fit(free_bytes, sum(kv * (w + max_new_tokens) for w in widths) + prefill, cap=cap)


def plan_groups(lengths: list[int], rows_for: Callable[[int], int], width_of: Callable[[int], int],
                group_cost: float = 0.0, position_cost: float = 0.0, max_new_tokens: int = 0,
                pad_rows: bool = False) -> list[list[int]]:
    """Groups of prompt indices, longest prompts first, each of at most `rows_for(width of its longest)`.

    Without costs every group is filled in order. With them (static cache), prompts are first split
    into runs of consecutive widths that minimize groups * group_cost + sum over rows of
    (run width + max_new_tokens) * position_cost, and groups never cross a run. `pad_rows`: every group
    runs rows_for(width) rows (its padding rows cost as much as real ones).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    runs = [order]
    if position_cost and order:
        buckets: list[tuple[int, list[int]]] = []  # (width, prompts), widest first
        for i in order:
            w = width_of(lengths[i])
            if buckets and buckets[-1][0] == w:
                buckets[-1][1].append(i)
            else:
                buckets.append((w, [i]))
        best, cut = [0.0] + [float("inf")] * len(buckets), [0] * (len(buckets) + 1)
        for j in range(1, len(buckets) + 1):  # best[j]: cheapest plan of buckets[:j]; a run takes its first width
            n = 0
            for a in range(j - 1, -1, -1):
                n += len(buckets[a][1])
                w = buckets[a][0]
                groups, rows = -(-n // rows_for(w)), n
                if pad_rows:
                    rows = groups * rows_for(w)
                cost = best[a] + groups * group_cost + rows * (w + max_new_tokens) * position_cost
                if cost < best[j]:
                    best[j], cut[j] = cost, a
        runs, j = [], len(buckets)
        while j:
            runs.append([i for _, idx in buckets[cut[j]: j] for i in idx])
            j = cut[j]
        runs.reverse()
    groups = []
    for run in runs:
        i = 0
        while i < len(run):
            n = max(1, rows_for(width_of(lengths[run[i]])))
            groups.append(run[i: i + n])
            i += n
    return groups


class HFGenerator:
    """`generate(prompts, seed)` -> [(text, new_tokens, hit_max_new_tokens)] in prompt order; greedy at
    temperature 0. `generate_groups` yields (prompt index, result) group by group as they finish."""

    def __init__(self, target_path, tokenizer, stop_ids: list[int], max_new_tokens: int, temperature: float,
                 device: str | None = None, static_cache: bool | None = None, compile_config=None,
                 dtype: str = "auto", max_prompt_length: int | None = None):
        import torch

        from dflash_train.target import load_target, target_torch_dtype

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = target_torch_dtype(dtype, device)  # auto: bfloat16 on CUDA, float32 on CPU
        self.model, _ = load_target(target_path, dtype=dtype, device=device)
        self.device, self.tokenizer = device, tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.stop_ids = list(stop_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        # static cache + compile on CUDA; tests turn the static path on for CPU (eager, or compiled
        # through `compile_config` with `_compile_all_devices`)
        self.static = device == "cuda" if static_cache is None else static_cache
        if self.static:  # the compiled decode step reads each cached K/V head once (data/gqa_decode.py)
            from dflash_train.data.gqa_decode import use_gqa_decode

            use_gqa_decode(self.model)
        self.compile_config = compile_config
        self.max_rows = MAX_ROWS_CUDA if self.static else MAX_ROWS_CPU
        self.dtype_bytes = torch.empty((), dtype=dtype).element_size()
        self.free_bytes = torch.cuda.mem_get_info(torch.device(device))[0] if device == "cuda" else None
        self._oom_cap: int | None = None  # rows per group after an out-of-memory error (this width and wider)
        self._oom_width = 0
        # static: the ladder widths whose caches are all kept (rows sized so they fit together); else none
        self.widths = ladder_up_to(max_prompt_length) if self.static and max_prompt_length else []
        self._fixed = None
        if self.widths and self.free_bytes is not None:
            self._fixed = fixed_rows(self.model.config, self.dtype_bytes, self.widths, max_new_tokens,
                                     self.free_bytes, cap=self.max_rows)
        self._caches: dict[int, tuple[int, int, object]] = {}  # width -> (rows, length, StaticCache)

    # ---- planning -------------------------------------------------------------------------------
    def width_of(self, n: int) -> int:
        return ladder_width(n) if self.static else n

    def rows_for(self, width: int) -> int:
        rows = self.max_rows
        if width in self.widths:
            rows = self._fixed or self.max_rows
        elif self.free_bytes is not None:
            row = bytes_per_row(self.model.config, self.dtype_bytes, width, self.max_new_tokens)
            rows = rows_that_fit(self.free_bytes, row, cap=self.max_rows)
        if self._oom_cap is not None and width >= self._oom_width:
            rows = min(rows, self._oom_cap)
        return rows

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], seed: int = 0):
        out = [None] * len(prompts)
        for i, r in self.generate_groups(prompts, seed):
            out[i] = r
        return out

    def plan(self, prompts: list[list[int]]) -> list[list[int]]:
        if not self.static:
            return plan_groups([len(p) for p in prompts], self.rows_for, self.width_of)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return plan_groups([len(p) for p in prompts], self.rows_for, self.width_of, group_cost=STEP_BYTES + weights,
                           position_cost=kv_bytes_per_token(self.model.config, self.dtype_bytes),
                           max_new_tokens=self.max_new_tokens, pad_rows=True)

    def generate_groups(self, prompts: list[list[int]], seed: int = 0) -> Iterator[tuple[int, tuple]]:
        import torch

        todo = self.plan(prompts)[::-1]  # a stack: groups split after an out-of-memory error go back on top
        g = 0
        while todo:
            group = todo.pop()
            cap = self.rows_for(self.width_of(max(len(prompts[i]) for i in group)))
            if len(group) > cap:  # the cap fell after an out-of-memory error
                todo += [group[k: k + cap] for k in range(0, len(group), cap)][::-1]
                continue
            try:
                results = self._generate([prompts[i] for i in group], seed + g)
            except torch.OutOfMemoryError:
                if len(group) == 1:
                    raise DataError(f"regenerate --engine hf: one prompt of {len(prompts[group[0]])} tokens with "
                                    f"--max-new-tokens {self.max_new_tokens} does not fit in the GPU's memory; lower "
                                    "--max-new-tokens or the data's max_length, or use --engine vllm") from None
                results = None  # handled below, once the exception and the tensors its frames hold are gone
            if results is None:
                self._release(empty=True)
                half = (len(group) + 1) // 2
                self._oom_cap = half if self._oom_cap is None else min(self._oom_cap, half)
                w = self.width_of(max(len(prompts[i]) for i in group))
                self._oom_width = w if self._oom_width == 0 else min(self._oom_width, w)
                todo += [group[half:], group[:half]]
                continue
            g += 1
            yield from zip(group, results, strict=True)

    def _generate(self, prompts: list[list[int]], seed: int):
        import torch

        n = len(prompts)
        width = self.width_of(max(len(p) for p in prompts))
        rows = self.rows_for(width) if self.static else n  # one row count per width: one compiled shape
        batch = prompts + [prompts[0]] * (rows - n)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for r, p in enumerate(batch):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        extra = {}
        if self.static:
            extra["past_key_values"] = self._static_cache(rows, width + self.max_new_tokens)
            if self.compile_config is not None:
                extra["compile_config"] = self.compile_config
        torch.manual_seed(seed)
        sample = self.temperature > 0
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=self.max_new_tokens, do_sample=sample,
                                  temperature=self.temperature if sample else None, top_p=None, top_k=None,
                                  eos_token_id=self.stop_ids, pad_token_id=self.pad_id, **extra)
        results = []
        for row in out[:n, width:].tolist():
            new = []
            for t in row:
                if t in self.stop_ids:
                    break
                new.append(t)
            hit_max = len(new) >= self.max_new_tokens
            results.append((self.tokenizer.decode(new, skip_special_tokens=True).strip(), len(new), hit_max))
        return results

    def _static_cache(self, rows: int, length: int):
        """This width's cache (reset) when its shape is unchanged, else a new one. Caches of the planned
        widths are all kept (they fit together); any other width keeps only the last one."""
        width = length - self.max_new_tokens
        kept = self._caches.get(width)
        if kept is not None and kept[:2] == (rows, length):
            kept[2].reset()
            return kept[2]
        # freed caches' memory goes to the new one: this width's of another row count (an out-of-memory
        # cap), and, for a width outside the plan, the last such cache
        stale = [w for w in self._caches if w == width or (width not in self.widths and w not in self.widths)]
        for w in stale:
            del self._caches[w]
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._caches[width] = (rows, length, cache)
        return cache

    def _release(self, empty: bool = False) -> None:
        self._caches = {}
        if empty and self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

