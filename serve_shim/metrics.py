"""Acceptance metrics from a running server's Prometheus `/metrics` text.

vLLM exposes counters; mean acceptance length = 1 + accepted / drafts, draft acceptance rate =
accepted / draft tokens, and the rate at position k = accepted_at_k / drafts. SGLang exposes an
accept-length gauge. Every series is summed over its label sets (engine, model_name, ...).
"""

from __future__ import annotations

import math
import re

from pydantic import BaseModel

from dflash_train.errors import DFlashError

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Sample(BaseModel):
    name: str
    labels: dict[str, str]
    value: float


class SpecStats(BaseModel):
    """What `dflash-serve stats` prints (and `--json` dumps)."""

    engine: str  # "vllm", "sglang" or "none"
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    mean_acceptance_length: float | None = None
    draft_acceptance_rate: float | None = None
    per_position_acceptance_rate: list[float] = []
    sglang_accept_length: float | None = None
    sglang_accept_rate: float | None = None


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of the Prometheus text exposition format (comments and blank lines skipped)."""
    samples = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise DFlashError(f"/metrics line {lineno}: not a Prometheus sample: {line[:120]!r}")
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError as exc:
            raise DFlashError(f"/metrics line {lineno}: bad value {value!r}") from exc
        parsed = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(labels or "")}
        samples.append(Sample(name=name, labels=parsed, value=number))
    return samples


def total(samples: list[Sample], name: str) -> float | None:
    """Sum of `name` over all its label sets; None when the server does not expose it."""
    values = [s.value for s in samples if s.name == name and not math.isnan(s.value)]
    return sum(values) if values else None


def mean_gauge(samples: list[Sample], name: str) -> float | None:
    """Mean of a gauge over its label sets (ranks report the same quantity; summing would not)."""
    values = [s.value for s in samples if s.name == name and not math.isnan(s.value)]
    return sum(values) / len(values) if values else None


def spec_stats(text: str) -> SpecStats:
    samples = parse_prometheus(text)
    drafts = total(samples, DRAFTS)
    if drafts is not None:
        accepted = total(samples, ACCEPTED) or 0.0
        draft_tokens = total(samples, DRAFT_TOKENS)
        by_pos: dict[int, float] = {}
        for s in samples:
            if s.name == PER_POS and "position" in s.labels:
                pos = int(s.labels["position"])
                by_pos[pos] = by_pos.get(pos, 0.0) + s.value
        per_pos = [by_pos.get(k, 0.0) / drafts if drafts else 0.0 for k in range(max(by_pos) + 1)] if by_pos else []
        return SpecStats(
            engine="vllm", drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
            mean_acceptance_length=1.0 + accepted / drafts if drafts else None,
            draft_acceptance_rate=accepted / draft_tokens if draft_tokens else None,
            per_position_acceptance_rate=per_pos,
        )
    length = mean_gauge(samples, SGLANG_ACCEPT_LENGTH)
    if length is not None:
        return SpecStats(engine="sglang", sglang_accept_length=length,
                         sglang_accept_rate=mean_gauge(samples, SGLANG_ACCEPT_RATE))
    return SpecStats(engine="none")


def stats_between(before: SpecStats, after: SpecStats) -> SpecStats:
    """vLLM numbers for the requests served between two snapshots (counters only grow)."""
    if before.engine != "vllm" or after.engine != "vllm":
        raise DFlashError("stats_between needs two vLLM snapshots (spec-decode counters)")
    drafts = after.drafts - before.drafts
    accepted = after.accepted_tokens - before.accepted_tokens
    draft_tokens = (after.draft_tokens or 0.0) - (before.draft_tokens or 0.0)
    n = len(after.per_position_acceptance_rate)
    old = before.per_position_acceptance_rate + [0.0] * (n - len(before.per_position_acceptance_rate))
    counts = [a * after.drafts - b * before.drafts for a, b in zip(after.per_position_acceptance_rate, old[:n], strict=True)]
    return SpecStats(engine="vllm", drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                     mean_acceptance_length=1.0 + accepted / drafts if drafts else None,
                     draft_acceptance_rate=accepted / draft_tokens if draft_tokens else None,
                     per_position_acceptance_rate=[c / drafts if drafts else 0.0 for c in counts])


def fetch_metrics(url: str, timeout: float = 10.0) -> str:
    """GET `URL/metrics` (URL may already end in /metrics)."""
    import urllib.error
    import urllib.request

    target = url.rstrip("/")
    if not target.endswith("/metrics"):
        target += "/metrics"
    if "://" not in target:
        target = "http://" + target
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise DFlashError(f"stats {url}: cannot read {target} ({exc}); is the server running and is "
                          "URL its base address (e.g. http://127.0.0.1:8000)?") from exc


def render(stats: SpecStats, url: str) -> str:
    """Human-readable lines for the terminal."""
    if stats.engine == "none":
        return (f"{url}: no speculative-decoding metrics found (no {DRAFTS} and no SGLang accept-length "
                "gauge); is the server running with a drafter?")
    if stats.engine == "sglang":
        rate = "" if stats.sglang_accept_rate is None else f"\n  accept rate (gauge): {stats.sglang_accept_rate:.4f}"
        return f"{url} (SGLang)\n  accept length (gauge): {stats.sglang_accept_length:.4f}{rate}"
    lines = [f"{url} (vLLM)",
             f"  drafts: {stats.drafts:.0f}   draft tokens: {stats.draft_tokens or 0:.0f}   "
             f"accepted tokens: {stats.accepted_tokens:.0f}"]
    if stats.mean_acceptance_length is None:
        lines.append("  no drafts yet: send a request first")
        return "\n".join(lines)
    lines.append(f"  mean acceptance length: {stats.mean_acceptance_length:.4f}")
    if stats.draft_acceptance_rate is not None:
        lines.append(f"  draft acceptance rate: {stats.draft_acceptance_rate:.4f}")
    if stats.per_position_acceptance_rate:
        rates = "  ".join(f"{k}:{r:.3f}" for k, r in enumerate(stats.per_position_acceptance_rate))
        lines.append(f"  per-position acceptance rate: {rates}")
    return "\n".join(lines)
