"""Background I/O for the offline feature cache: the target's forward never waits on the disk.

The main thread runs the forward and hands each batch to `BackgroundWriter.submit`; on CUDA the
batch's outputs are first copied to pinned host memory on a side stream (`to_host`), so the copy
overlaps the next forward. Writer threads wait for that copy, write the batch's rows at their
offsets in the shard file (`os.pwrite`: threads share a file safely), and the thread that writes a
shard's last batch finishes it: fsync, rename from the temp name, sha256, manifest update.

The queue is bounded (`max_pending` batches), so host memory stays at a few batches: when the
disk is slower than the forward, `submit` blocks and the time it blocked is counted (`waited_s`).
The first error in a writer thread stops the writers and is raised in the main thread by the next
`submit` or by `close`; the shards that were not finished stay temp files and a rerun recomputes
them (finished shards are kept, see `cache.py`).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time

import torch

from dflash_train.errors import DataError

DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16"), "float32": (torch.float32, "F32")}
FORMAT = "dflash-feature-cache"


class ShardWriter:
    """One safetensors file whose layout is fixed up front; rows are written at their offsets.

    `pending`/`sealed` count the batches submitted for this shard and still unwritten: the shard is
    finished when it is sealed (every batch submitted) and nothing is pending.
    """

    def __init__(self, path, lengths: list[int], row_index: list[int], feature_dim: int, dtype: str,
                 topk: int = 0):
        self.path, self.feature_dim, self.topk = path, feature_dim, topk
        self.torch_dtype, st_dtype = DTYPES[dtype]
        self.item = torch.empty((), dtype=self.torch_dtype).element_size()
        n, r = sum(lengths), len(lengths)
        self.tokens = n
        self.tok_off = [0]
        for length in lengths:
            self.tok_off.append(self.tok_off[-1] + length)
        specs = [("features", st_dtype, [n, feature_dim], n * feature_dim * self.item),
                 ("input_ids", "I64", [n], 8 * n), ("loss_mask", "U8", [n], n),
                 ("greedy_next", "I64", [n], 8 * n), ("row_offsets", "I64", [r + 1], 8 * (r + 1)),
                 ("row_index", "I64", [r], 8 * r)]
        if topk:  # the kl loss's teacher: int32 ids and bf16 log-probs, aligned like greedy_next
            specs += [("target_topk_ids", "I32", [n, topk], 4 * n * topk),
                      ("target_topk_logp", "BF16", [n, topk], 2 * n * topk)]
        header, pos = {"__metadata__": {"format": FORMAT}}, 0
        self.base = {}
        for name, st, shape, nbytes in specs:
            header[name] = {"dtype": st, "shape": shape, "data_offsets": [pos, pos + nbytes]}
            self.base[name] = pos
            pos += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.data_start = 8 + len(blob)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.closed = False
        os.pwrite(self.fd, struct.pack("<Q", len(blob)) + blob, 0)
        os.ftruncate(self.fd, self.data_start + pos)
        self._put("row_offsets", 0, torch.tensor(self.tok_off, dtype=torch.int64))
        self._put("row_index", 0, torch.tensor(row_index, dtype=torch.int64))
        self.lock = threading.Lock()
        self.pending, self.sealed = 0, False

    def _put(self, name: str, byte_off: int, t: torch.Tensor) -> None:
        data = t.contiguous().view(torch.uint8).numpy()  # no copy: pwrite reads the tensor's memory
        off = self.data_start + self.base[name] + byte_off
        while data.size:  # pwrite may write less than asked
            n = os.pwrite(self.fd, data, off)
            data, off = data[n:], off + n

    def put_row(self, r: int, ids: torch.Tensor, mask: torch.Tensor, feats: torch.Tensor, greedy: torch.Tensor,
                topk_ids: torch.Tensor | None = None, topk_logp: torch.Tensor | None = None):
        t0 = self.tok_off[r]
        self._put("features", t0 * self.feature_dim * self.item, feats.to(self.torch_dtype))
        self._put("input_ids", t0 * 8, ids.to(torch.int64))
        self._put("loss_mask", t0, mask.to(torch.uint8))
        self._put("greedy_next", t0 * 8, greedy.to(torch.int64))
        if self.topk:
            self._put("target_topk_ids", t0 * 4 * self.topk, topk_ids.to(torch.int32))
            self._put("target_topk_logp", t0 * 2 * self.topk, topk_logp.to(torch.bfloat16))

    def add_pending(self) -> None:
        with self.lock:
            self.pending += 1

    def done_one(self) -> bool:
        """One batch written; True when that was the sealed shard's last."""
        with self.lock:
            self.pending -= 1
            return self.sealed and self.pending == 0

    def seal(self) -> bool:
        """Every batch submitted; True when all are written already."""
        with self.lock:
            self.sealed = True
            return self.pending == 0

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.fsync(self.fd)
            os.close(self.fd)

    def abandon(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


def to_host(tensors: list[torch.Tensor], stream=None) -> tuple[list[torch.Tensor], object]:
    """CPU copies of `tensors` and an event to wait for. On CUDA: pinned memory, copied on `stream`
    after the work queued so far, so the next forward runs while the copy does."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.cpu() for t in tensors], None
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
        event = torch.cuda.Event()
        event.record(stream)
    for t in tensors:
        t.record_stream(stream)  # the caching allocator must not reuse them before the copy ran
    return host, event


class BackgroundWriter:
    """A bounded queue of jobs run by `threads` writer threads; see the module docstring."""

    def __init__(self, threads: int = 1, max_pending: int = 2):
        self.jobs: queue.Queue = queue.Queue(maxsize=max(1, max_pending))
        self.error: BaseException | None = None
        self.waited_s = 0.0
        self.threads = [threading.Thread(target=self._loop, name=f"feature-writer-{i}", daemon=True)
                        for i in range(max(1, threads))]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args = job
            if self.error is None:
                try:
                    fn(*args)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                    if self.error is None:
                        self.error = exc

    def check(self) -> None:
        if self.error is None:
            return
        self._stop()  # the error stays set meanwhile: the other writers skip what is left
        exc, self.error = self.error, None
        if isinstance(exc, OSError):
            raise DataError(f"{getattr(exc, 'filename', None) or 'feature cache'}: writing the feature cache "
                            f"failed ({exc}); fix the cause (disk space, permissions) and rerun the same "
                            "command: finished shards are kept") from exc
        raise exc

    def submit(self, fn, *args) -> None:
        self.check()
        t0 = time.perf_counter()
        while True:
            try:
                self.jobs.put((fn, args), timeout=0.1)
                break
            except queue.Full:
                self.check()  # a dead writer must not leave the forward blocked forever
        self.waited_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for every job; raises the first writer error."""
        self._stop()
        self.check()

    def abort(self) -> None:
        """Stop without running what is queued (the main thread failed); a shard being finished is finished."""
        if self.error is None:
            self.error = _Aborted()
        self._stop()
        self.error = None

    def _stop(self) -> None:
        if not any(t.is_alive() for t in self.threads):
            return
        if self.error is not None:  # drop what is queued: it would not run anyway
            while True:
                try:
                    self.jobs.get_nowait()
                except queue.Empty:
                    break
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()


class _Aborted(Exception):
    pass


def shard_batches(lengths: list[int], batch_size: int | None, max_tokens: int | None = None) -> list[list[int]]:
    """Batches of a shard's rows, longest first so each batch pads little: at most `batch_size` rows
    and at most `max_tokens` padded tokens (rows x the first row's length) where given."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    batches: list[list[int]] = []
    for r in order:
        cur = batches[-1] if batches else None
        if (cur is None or (batch_size is not None and len(cur) >= batch_size)
                or (max_tokens is not None and (len(cur) + 1) * lengths[cur[0]] > max_tokens)):
            batches.append([r])
        else:
            cur.append(r)
    return batches
