"""Background writer of the feature cache: bounded queue, errors raised in the main thread, threads
writing one shard file at once (real files)."""

from __future__ import annotations

import errno
import json
import struct
import threading
import time

import pytest
import torch

from dflash_train.errors import DataError
from dflash_train.features.cache_writer import BackgroundWriter, ShardWriter, to_host


def test_queue_is_bounded_and_blocked_time_is_counted():
    release, ran = threading.Event(), []
    pool = BackgroundWriter(threads=1, max_pending=2)
    pool.submit(release.wait)  # the one writer is busy until released
    time.sleep(0.2)
    pool.submit(ran.append, 1)
    pool.submit(ran.append, 2)  # the queue holds 2
    blocked = threading.Thread(target=pool.submit, args=(ran.append, 3))
    blocked.start()
    blocked.join(0.5)
    assert blocked.is_alive() and ran == []  # the third waits for room
    release.set()
    blocked.join(5)
    pool.close()
    assert ran == [1, 2, 3] and pool.waited_s >= 0.4


def test_disk_errors_reach_the_main_thread_as_one_line():
    def full_disk(path):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    pool = BackgroundWriter(threads=2, max_pending=1)
    done = []
    pool.submit(full_disk, "/data/features/.shard-00003.safetensors.tmp")
    with pytest.raises(DataError, match=r"shard-00003\.safetensors\.tmp: writing the feature cache failed "
                                        r"\(.*No space left.*\); .*rerun the same command"):
        for _ in range(200):  # the forward goes on until the error shows at a submit
            pool.submit(done.append, 1)
            time.sleep(0.01)
    assert not any(t.is_alive() for t in pool.threads)
    pool.close()  # nothing left to raise


def test_bugs_keep_their_type():
    pool = BackgroundWriter(threads=1)
    pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        pool.close()


def test_abort_drops_queued_jobs():
    release, ran = threading.Event(), []
    pool = BackgroundWriter(threads=1, max_pending=4)
    pool.submit(release.wait)
    for i in range(3):
        pool.submit(ran.append, i)
    threading.Timer(0.2, release.set).start()
    pool.abort()
    assert ran == [] and not any(t.is_alive() for t in pool.threads)


def test_threads_write_rows_of_one_shard_at_their_offsets(tmp_path):
    """Rows written by 4 threads in any order give a valid safetensors file with every row in place."""
    from safetensors import safe_open

    lengths = [5, 1, 7, 3, 4, 6, 2, 8]
    dim = 12
    shard = ShardWriter(tmp_path / "s.tmp", lengths, list(range(10, 18)), dim, "bfloat16")
    feats = [torch.randn(n, dim) for n in lengths]
    ids = [torch.randint(0, 1000, (n,)) for n in lengths]
    masks = [torch.randint(0, 2, (n,)) for n in lengths]
    greedy = [torch.randint(0, 1000, (n,)) for n in lengths]
    pool = BackgroundWriter(threads=4, max_pending=2)
    for r in reversed(range(len(lengths))):
        shard.add_pending()
        pool.submit(lambda r=r: (shard.put_row(r, ids[r], masks[r], feats[r], greedy[r]), shard.done_one()))
    shard.seal()
    pool.close()
    assert shard.pending == 0 and shard.sealed
    shard.close()
    raw = (tmp_path / "s.tmp").read_bytes()
    header = json.loads(raw[8: 8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["features"]["shape"] == [sum(lengths), dim]
    with safe_open(str(tmp_path / "s.tmp"), framework="pt") as f:
        off = f.get_tensor("row_offsets").tolist()
        assert f.get_tensor("row_index").tolist() == list(range(10, 18))
        for r, n in enumerate(lengths):
            a, b = off[r], off[r + 1]
            assert b - a == n
            assert torch.equal(f.get_tensor("features")[a:b], feats[r].to(torch.bfloat16))
            assert torch.equal(f.get_tensor("input_ids")[a:b], ids[r])
            assert torch.equal(f.get_tensor("loss_mask")[a:b], masks[r].to(torch.uint8))
            assert torch.equal(f.get_tensor("greedy_next")[a:b], greedy[r])


def test_to_host_on_cpu_is_a_no_op():
    t = torch.arange(6.0)
    host, event = to_host([t])
    assert host[0] is t and event is None


@pytest.mark.gpu
def test_to_host_copies_on_a_side_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.randn(64, 1024, device="cuda")
    y = x @ x.T  # queued on the compute stream; the copy must wait for it
    host, event = to_host([y, x.argmax(-1)], torch.cuda.Stream())
    event.synchronize()
    assert host[0].is_pinned() and torch.equal(host[0], y.cpu()) and torch.equal(host[1], x.argmax(-1).cpu())
