"""HF regeneration for `regenerate --engine hf`: length-sorted groups, greedy rows through our own loop over a
static KV cache (`data/static_decode.py`), on CUDA its decode steps replayed from a recorded CUDA graph in groups
sized to the GPU's free memory, on a CPU in large groups that finished rows leave.

The prompts of one call are sorted by length (longest first) and cut into groups, each decoded with left
padding; its rows are handed back as soon as it ends, so the caller can write finished rows at once
(`generate_groups`).

CPU, greedy rows (since 2026-12-06): the loop, eager, up to 128 rows a group (fewer where their cache and
prefill pass CPU_GROUP_BYTES), each group padded to its own longest prompt (no ladder), and at every check a
group where a quarter of the decoding rows have finished drops them (`shrink`). A CPU decode step costs a fixed
~100 ms (SmolLM2 on 2 cores: the weights streamed from memory, ~2,400 operator calls) plus ~2.5 ms a row (fp32),
so a step of 128 rows makes ~300 tokens/s where one of 8 makes 69; what large groups used to lose was the rows
that had finished and kept decoding until the group's longest answer ended. Groups are planned by the same
exact split as on CUDA, here a group costing its decode steps' fixed time (CPU_POSITIONS_PER_STEP prefill
positions a step) and a padded prompt position its prefill. On the demo's prompts (256 rows, <= 128 new tokens,
2 Xeon cores with AMX, 2026-12-06): fp32 200 new tokens/s against `generate`'s 123, bf16 270 against 192, fp32
under an AVX2 cap 170 against 108; vLLM's CPU build on the same rows 388, 1,042 and 313. The fp32 rows equal
`generate`'s; bf16 rows round by their batch and part from them. Sampling (temperature > 0) keeps `generate`
with a dynamic cache, 32 rows a group padded to their longest prompt.

CUDA:
- greedy rows (temperature 0, what regeneration uses) decode over a transformers `StaticCache` in
  `data/static_decode.py`'s loop, not `generate`, with no read of the device between steps but one every 16;
  the prefill stays eager. Each decode step replays a CUDA graph recorded from the eager call, one per group
  (`data/decode_graph.py`: no compile to pay; `decode_step="graphs"`, the default on CUDA where the cache
  allows it), or runs `torch.compile`d as `generate` compiles it (inductor, mode "reduce-overhead";
  `"compiled"`, the default before 2026-12-06 and where the cache cannot be recorded), or eager (`"eager"`).
  Sampling keeps `generate` with the static cache.
  Attention is `data/gqa_decode.py`'s: a decode step reads each cached K/V head once, where transformers'
  compiled SDPA path with a mask would repeat them.
- a group's width (its padded prompt length) is rounded up to a ladder of two steps per octave (64, 96,
  128, 192, 256, 384, ...); its cache holds width + max_new_tokens positions. Each width gets the rows
  that fit its own cache and prefill (`rows_that_fit`), so short prompts run in large groups and long
  ones in small groups; a group that is not full runs its own rows, never padded (an earlier version
  padded it with copies of its first prompt, and sized every width for all widths' caches together:
  215 of 512 rows in one width-2048 group of 304 rows, 89 of them copies). A recorded step is one graph per
  group; the compiled step sees a few shapes per width, and after the first recompile dynamo compiles one
  dynamic-shape graph, and the CUDA graph trees record one graph per shape, a decode step each.
- caches are kept, keyed by shape, and reset when a group of the same shape comes again (a CUDA graph
  recorded over a cache's addresses stays valid); they are kept while they fit beside the current
  group (SAFETY x the free memory measured after loading the model), the least recently used dropped
  first (`_static_cache`).
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

from dflash_train.data import static_decode
from dflash_train.data.decode_graph import GraphedStep, recordable
from dflash_train.errors import DataError
from dflash_train.target import cache_kwarg

SAFETY = 0.6
MAX_ROWS_CPU = 32  # `generate` on a CPU (sampling): every row runs until its group's longest answer ends
MAX_ROWS_CPU_LOOP = 128  # the greedy loop on a CPU, finished rows leaving the batch
CPU_GROUP_BYTES = 2 * 2**30  # a CPU group's cache and prefill (`bytes_per_row`), beside the model
MAX_ROWS_CUDA = 1024
MIN_ROWS_CUDA = 16
STEP_BYTES = 4 * 10**9
CPU_POSITIONS_PER_STEP = 80  # a CPU decode step's fixed cost in prefill positions (SmolLM2, 2 cores: ~100 ms, ~1.2 ms)
DECODE_STEPS = ("auto", "graphs", "compiled", "eager")  # the greedy loop's decode step (HFGenerator)


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


def plan_groups(lengths: list[int], rows_for: Callable[[int], int], width_of: Callable[[int], int],
                group_cost: float = 0.0, position_cost: float = 0.0, max_new_tokens: int = 0) -> list[list[int]]:
    """Groups of prompt indices, longest prompts first, each of at most `rows_for(width of its longest)`.

    Without costs every group is filled in order. With them (static cache), prompts are first split
    into runs of consecutive widths that minimize groups * group_cost + sum over rows of
    (run width + max_new_tokens) * position_cost, and groups never cross a run.
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
                groups = -(-n // rows_for(w))
                cost = best[a] + groups * group_cost + n * (w + max_new_tokens) * position_cost
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
                 dtype: str = "auto", greedy_loop: bool = True, decode_step: str = "auto", shrink: bool | None = None):
        import torch

        from dflash_train.target import load_target, target_torch_dtype

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = target_torch_dtype(dtype, device)  # auto: bfloat16 on CUDA, float32 on CPU
        self.model, _ = load_target(target_path, dtype=dtype, device=device)
        self.device, self.tokenizer = device, tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.stop_ids = list(stop_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        # the greedy loop over a static cache on CUDA, and on a CPU for greedy rows, where finished rows leave the
        # batch (`shrink`) and groups are planned for the CPU's costs; tests turn the CUDA path on for a CPU with
        # static_cache=True (eager, or compiled through `compile_config` with `_compile_all_devices`)
        cpu_loop = device != "cuda" and static_cache is None and temperature == 0
        self.static = (device == "cuda" or cpu_loop) if static_cache is None else static_cache
        if self.static:  # the compiled decode step reads each cached K/V head once (data/gqa_decode.py)
            from dflash_train.data.gqa_decode import use_gqa_decode

            use_gqa_decode(self.model)
        self.compile_config = compile_config
        self.greedy_loop = greedy_loop  # False: greedy rows also go through `generate` (the bench's baseline)
        if decode_step not in DECODE_STEPS:
            raise ValueError(f"decode_step must be one of {', '.join(DECODE_STEPS)}, got {decode_step!r}")
        # the greedy loop's decode step: "auto" is "graphs" on CUDA where the cache can be recorded, else "compiled"
        # (eager on a CPU unless `compile_config` compiles everywhere); the bench compares them (`regen-compiled`,
        # `regen-eager`)
        self.decode_step = decode_step
        # finished rows leave a group's batch (static_decode.greedy_decode): on a CPU, whose step costs its rows
        self.shrink = cpu_loop if shrink is None else shrink
        self._step = None  # the compiled or eager decode step's model call, made at its first group
        self.max_rows = MAX_ROWS_CPU_LOOP if self.shrink else MAX_ROWS_CUDA if self.static else MAX_ROWS_CPU
        self.dtype_bytes = torch.empty((), dtype=dtype).element_size()
        self.free_bytes = torch.cuda.mem_get_info(torch.device(device))[0] if device == "cuda" else None
        self._oom_cap: int | None = None  # rows per group after an out-of-memory error (this width and wider)
        self._oom_width = 0
        # static: kept caches, least recently used first: (rows, length) -> StaticCache
        self._caches: dict[tuple[int, int], object] = {}

    # ---- planning -------------------------------------------------------------------------------
    def width_of(self, n: int) -> int:
        return ladder_width(n) if self.static and not self.shrink else n

    def rows_for(self, width: int) -> int:
        """Rows of a group of this width: what its own cache and prefill fit on CUDA (`rows_that_fit`),
        at most `max_rows`, at most the cap an out-of-memory error set for this width and wider."""
        rows = self.max_rows
        if self.free_bytes is not None or self.shrink:
            row = bytes_per_row(self.model.config, self.dtype_bytes, width, self.max_new_tokens)
            rows = (rows_that_fit(self.free_bytes, row, cap=self.max_rows) if self.free_bytes is not None
                    else min(self.max_rows, max(1, CPU_GROUP_BYTES // row)))
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
        if self.shrink:  # a CPU: a group costs its decode steps' fixed overhead, a padded position its prefill
            return plan_groups([len(p) for p in prompts], self.rows_for, self.width_of,
                               group_cost=self.max_new_tokens * CPU_POSITIONS_PER_STEP, position_cost=1.0)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return plan_groups([len(p) for p in prompts], self.rows_for, self.width_of, group_cost=STEP_BYTES + weights,
                           position_cost=kv_bytes_per_token(self.model.config, self.dtype_bytes),
                           max_new_tokens=self.max_new_tokens)

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
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)  # left padding; no padding rows
        mask = torch.zeros((n, width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        extra = {}
        sample = self.temperature > 0
        if self.static and not sample and self.greedy_loop:  # our decode loop, no host sync per step
            cache = self._static_cache(n, width)
            step = self._decode_step_for(cache)
            new_tokens = static_decode.greedy_decode(self.model, step, ids.to(self.device), mask.to(self.device),
                                                     cache, self.max_new_tokens, self.stop_ids, self.pad_id,
                                                     shrink=self.shrink and not isinstance(step, GraphedStep)).tolist()
            if isinstance(step, GraphedStep) and step.failed is not None:
                self.decode_step = "compiled"  # the step warned; later groups take the compiled step, as before
        else:
            if self.static:
                extra[cache_kwarg(self.model)] = self._static_cache(n, width)
                if self.compile_config is not None:
                    extra["compile_config"] = self.compile_config
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=self.max_new_tokens, do_sample=sample,
                                      temperature=self.temperature if sample else None, top_p=None, top_k=None,
                                      eos_token_id=self.stop_ids, pad_token_id=self.pad_id, **extra)
            new_tokens = out[:, width:].tolist()
        results = []
        for row in new_tokens:
            new = []
            for t in row:
                if t in self.stop_ids:
                    break
                new.append(t)
            hit_max = len(new) >= self.max_new_tokens
            results.append((self.tokenizer.decode(new, skip_special_tokens=True).strip(), len(new), hit_max))
        return results

    def _decode_step_for(self, cache):
        """The greedy loop's decode step for one group over `cache`: a new `GraphedStep` (it records over this
        group's buffers), or the compiled or eager model call, made once."""
        reason = recordable(cache) if self.decode_step in ("auto", "graphs") else None
        if self.decode_step == "auto":
            self.decode_step = "graphs" if self.device == "cuda" and reason is None else "compiled"
        if self.decode_step == "graphs":
            if reason is not None:
                raise ValueError(f"decode_step='graphs': this target's cache cannot be recorded ({reason}); use "
                                 "'compiled' or 'auto'")
            return GraphedStep(self.model)
        if self._step is None:
            self._step = (static_decode.compiled_forward(self.model, self.compile_config, self.device)
                          if self.decode_step == "compiled" else self.model.__call__)
        return self._step

    def _static_cache(self, rows: int, width: int):
        """The cache of this shape (reset) when one is kept, else a new one. Kept caches stay while they fit
        beside this group in SAFETY x free memory (on CUDA; elsewhere all are kept), the least recently used
        dropped first. Shrinking groups keep none: a group may leave its cache with fewer rows than it had."""
        from transformers import StaticCache

        length = width + self.max_new_tokens
        key = (rows, length)
        if self.shrink:
            return StaticCache(config=self.model.config, max_cache_len=length)
        kept = self._caches.pop(key, None)
        if kept is not None:
            kept.reset()
            self._caches[key] = kept  # now the most recently used
            return kept
        if self.free_bytes is not None:
            kv = kv_bytes_per_token(self.model.config, self.dtype_bytes)
            group = rows * bytes_per_row(self.model.config, self.dtype_bytes, width, self.max_new_tokens)
            while self._caches and group + sum(r * n * kv for r, n in self._caches) > SAFETY * self.free_bytes:
                del self._caches[next(iter(self._caches))]
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._caches[key] = cache
        return cache

    def _release(self, empty: bool = False) -> None:
        self._caches = {}
        if empty and self.device == "cuda":
            import torch

            torch.cuda.empty_cache()

