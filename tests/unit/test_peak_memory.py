"""RAM at a command's peak: a stage's processes summed while they run, and a run's high-water mark per lap."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

from dflash_train.peak_memory import GIB, TreePeak, high_water, tree_anonymous_bytes
from dflash_train.stages import Stage, run_stage

MIB = 1024**2

# a process that touches `mib` MiB and starts `children` that do the same (a stage's workers); all hold their memory
# together for `hold` seconds (the children until the parent releases them), then end
HOLDER = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path
    mib, hold, children, meet = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    kids = [subprocess.Popen([sys.executable, __file__, str(mib), "0", "-1", str(meet)]) for _ in range(children)]
    block = bytearray(mib * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])  # every page resident
    if children < 0:  # a child: say so, then hold until released
        (meet / f"ready-{os.getpid()}").touch()
        while not (meet / "release").exists():
            time.sleep(0.02)
        sys.exit(0)
    while len(list(meet.glob("ready-*"))) < children:
        time.sleep(0.02)
    print("holding", flush=True)
    time.sleep(hold)
    (meet / "release").touch()
    for kid in kids:
        kid.wait()
""")


def _holder(tmp_path, mib: int, hold: float, children: int) -> list[str]:
    script, meet = tmp_path / "holder.py", tmp_path / "meet"
    script.write_text(HOLDER)
    meet.mkdir(exist_ok=True)
    return [sys.executable, str(script), str(mib), str(hold), str(children), str(meet)]


def test_a_tree_peak_sums_a_process_and_its_children(tmp_path):
    proc = subprocess.Popen(_holder(tmp_path, 300, 1.0, 1), stdout=subprocess.PIPE, text=True)
    with TreePeak(proc.pid, interval=0.05) as peak:
        proc.wait()
    # two processes of ~300 MiB each, plus two interpreters (~10-30 MiB each)
    assert 600 * MIB < peak.bytes < 800 * MIB, peak.bytes / MIB
    assert tree_anonymous_bytes(proc.pid) == 0  # ended: nothing left to count


def test_a_stage_records_its_peak_and_prints_it(tmp_path, capfd):
    stage = Stage("hold", _holder(tmp_path, 200, 1.0, 2))
    run_stage(stage, io.StringIO(), prefix="[test]")
    assert stage.status == "ok" and stage.output == ["holding"]
    assert 600 * MIB < stage.peak_bytes < 800 * MIB, stage.peak_bytes / MIB  # three processes of 200 MiB
    line = capfd.readouterr().out.splitlines()[-1]
    assert line.startswith("[test] hold") and f"{round(stage.peak_bytes / GIB, 2)} GiB of RAM at its peak" in line


def test_the_high_water_mark_grows_with_this_process_and_its_finished_children(tmp_path):
    before = high_water()
    # the child first: a forked child's mark starts at its parent's resident set (before its exec)
    subprocess.run(_holder(tmp_path, 500, 0.2, 0), check=True, capture_output=True)
    after_child = high_water()
    # the largest child so far: this one, unless an earlier test's was larger
    assert after_child["children"] >= 0.48, (before, after_child)
    assert before["children"] >= 0.48 or after_child["children"] < 0.6, (before, after_child)
    block = bytearray(400 * MIB)
    block[::4096] = b"x" * len(block[::4096])
    grown = high_water()
    assert grown["process"] >= max(before["process"], 0.39) and grown["children"] == after_child["children"]
    del block


def test_a_mapped_files_pages_are_not_counted(tmp_path):
    # what the steps do to the feature cache: its pages are resident but the kernel can drop and re-read them
    import mmap
    import os

    import psutil

    from dflash_train.peak_memory import anonymous_bytes

    data = tmp_path / "features.bin"
    with open(data, "wb") as f:
        f.truncate(300 * MIB)
    me = psutil.Process()
    before_rss, before = me.memory_info().rss, tree_anonymous_bytes(os.getpid())
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        touched = sum(mapped[i] for i in range(0, len(mapped), 4096))  # every page read in
        memory = me.memory_info()
        assert touched == 0 and memory.rss - before_rss > 250 * MIB  # resident...
        assert anonymous_bytes(memory) - before < 50 * MIB  # ...but not anonymous
