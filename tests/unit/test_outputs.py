"""The output policy (dflash_train/outputs.py) on real folders and files: what is written, what is
refused with which message, and that a refused or failed write changes nothing on disk."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from dflash_train import outputs as o
from dflash_train.errors import DFlashError, OutputError
from dflash_train.outputs import MARKER, STAMP_KEY, folder_output, plan_output


def tree(root: Path) -> dict[str, tuple[int, str] | str]:
    """Every path under root with (size, sha256) for files: equal trees mean nothing changed."""
    out: dict = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in files:
            p = Path(dirpath, f)
            out[str(p.relative_to(root))] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def toolkit_folder(path: Path, command: str = "prepare", payload: bytes = b"old") -> Path:
    with folder_output(path, "--output", command) as tmp:
        (tmp / "data.bin").write_bytes(payload)
    return path


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("my thesis, do not lose")
    return path


def test_error_is_part_of_the_family():
    assert issubclass(OutputError, DFlashError)


# ---- folders ----------------------------------------------------------------------------

def test_new_folder_is_written_with_parents_and_marked(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    assert plan_output(out, "--output").action == o.NEW
    with folder_output(out, "--output", "to-zlab") as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".tmp-out-")
        (tmp / "w.bin").write_bytes(b"x" * 10)
    assert (out / "w.bin").read_bytes() == b"x" * 10
    marker = json.loads((out / MARKER).read_text())
    assert marker["tool"] == "dflash-toolkit" and marker["command"] == "to-zlab" and marker["created"].endswith("Z")
    assert o.folder_stamp(out)["command"] == "to-zlab"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temp left beside


def test_empty_folder_is_filled(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert plan_output(out, "--output").action == o.EMPTY
    with folder_output(out, "--output", "prepare") as tmp:
        (tmp / "x").write_text("1")
    assert (out / "x").read_text() == "1" and (out / MARKER).is_file()


@pytest.mark.parametrize("overwrite", [False, True, None])
def test_user_folder_is_never_replaced(tmp_path, overwrite):
    out = user_folder(tmp_path / "mine")
    before = tree(tmp_path)
    with pytest.raises(OutputError) as err:
        with folder_output(out, "--output", "prepare", overwrite=overwrite) as tmp:
            (tmp / "x").write_text("1")
    msg = str(err.value)
    assert msg.startswith(f"--output {out}: ") and "not a dflash-toolkit output" in msg and MARKER in msg
    assert "\n" not in msg and tree(tmp_path) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_regular_file_is_never_replaced_by_a_folder(tmp_path, overwrite):
    out = tmp_path / "report.bin"
    out.write_bytes(b"\x00user data")
    before = tree(tmp_path)
    with pytest.raises(OutputError, match=r"OUT .*report\.bin: is a file, not a folder"):
        plan_output(out, "OUT", overwrite=overwrite)
    assert tree(tmp_path) == before


def test_toolkit_folder_needs_overwrite_then_is_replaced_atomically(tmp_path):
    out = toolkit_folder(tmp_path / "prepared", "prepare", b"old")
    before = tree(tmp_path)
    with pytest.raises(OutputError, match=r"holds an earlier dflash-toolkit output \(prepare, .*--overwrite"):
        with folder_output(out, "--output", "prepare") as tmp:
            (tmp / "data.bin").write_bytes(b"new")
    assert tree(tmp_path) == before
    assert plan_output(out, "--output", overwrite=True).action == o.REPLACE
    with folder_output(out, "--output", "regenerate", overwrite=True) as tmp:
        (tmp / "data.bin").write_bytes(b"new")
    assert (out / "data.bin").read_bytes() == b"new" and o.folder_stamp(out)["command"] == "regenerate"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]  # the old one moved aside and deleted


def test_commands_without_overwrite_do_not_offer_it(tmp_path):
    out = toolkit_folder(tmp_path / "prepared")
    with pytest.raises(OutputError) as err:
        plan_output(out, "--output", overwrite=None)
    assert "--overwrite" not in str(err.value) and "choose a new path" in str(err.value)


def test_a_failed_write_changes_nothing(tmp_path):
    out = toolkit_folder(tmp_path / "d")
    before = tree(tmp_path)
    with pytest.raises(RuntimeError, match="disk on fire"):
        with folder_output(out, "--output", "prepare", overwrite=True) as tmp:
            (tmp / "data.bin").write_bytes(b"half")
            raise RuntimeError("disk on fire")
    assert tree(tmp_path) == before


def test_own_folder_is_continued_in_place_and_checked_writable(tmp_path):
    out = user_folder(tmp_path / "run")
    plan = plan_output(out, "--output", own=True)
    assert plan.action == o.OWN and plan.path == out


def test_own_folder_without_marker_may_be_replaced_by_its_command(tmp_path):
    """A run's final/ (own=True) is saved again on resume although an old save carries no marker."""
    out = user_folder(tmp_path / "final")
    with folder_output(out, "final", "train", own=True) as tmp:
        (tmp / "w").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "w"]


def test_symlink_is_refused(tmp_path):
    real = toolkit_folder(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OutputError, match="symbolic link"):
        plan_output(link, "OUT", overwrite=True)


def test_install_folder_never_takes_over_a_folder_that_appeared(tmp_path):
    tmp = tmp_path / ".tmp-x"
    tmp.mkdir()
    out = user_folder(tmp_path / "x")
    with pytest.raises(OutputError, match="appeared while the output was being written"):
        o.install_folder(tmp, out, replace_ok=False)
    assert (out / "notes.txt").read_text() == "my thesis, do not lose"


def test_discard_folder_removes_only_marked_folders(tmp_path):
    mine = user_folder(tmp_path / "mine.partial")
    ours = toolkit_folder(tmp_path / "ours.partial")
    assert o.discard_folder(mine) is False and (mine / "notes.txt").is_file()
    assert o.discard_folder(ours) is True and not ours.exists()
    assert o.discard_folder(tmp_path / "missing") is False


# ---- places that are never written -------------------------------------------------------

@pytest.mark.parametrize("relation, make_out", [
    ("is the source", lambda src: src),
    ("lies inside the source", lambda src: src / "final"),
    ("contains the source", lambda src: src.parent),
])
def test_source_relations_are_refused_even_with_overwrite(tmp_path, relation, make_out):
    src = toolkit_folder(tmp_path / "runs" / "run")  # a toolkit folder: --overwrite alone would allow it
    (src / "final").mkdir()
    before = tree(tmp_path)
    out = make_out(src)
    with pytest.raises(OutputError) as err:
        with folder_output(out, "OUT", "to-zlab", sources=[src], overwrite=True) as tmp:
            (tmp / "x").write_text("1")
    assert f"OUT {out}: {relation} {src}" in str(err.value)
    assert tree(tmp_path) == before


def test_source_through_a_symlink_is_recognised(tmp_path):
    src = toolkit_folder(tmp_path / "src")
    (tmp_path / "alias").symlink_to(src)
    with pytest.raises(OutputError, match="is the source"):
        plan_output(src, "OUT", sources=[tmp_path / "alias"], overwrite=True)


def test_hub_ids_and_missing_sources_are_not_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert plan_output(tmp_path / "org", "OUT", sources=["org/model", None, "", tmp_path / "gone"]).action == o.NEW


def test_current_home_root_and_their_parents_are_refused(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    (work / "data.jsonl").write_text("{}\n")
    before = tree(tmp_path)
    for out, needle in ((".", "is the current folder"), (str(work), "is the current folder"),
                        (str(home), "is your home folder"), ("/", "is the filesystem root"),
                        ("..", "is your home folder"), (str(tmp_path), "contains the current folder")):
        with pytest.raises(OutputError) as err:
            plan_output(out, "--output", overwrite=True)
        assert str(err.value).startswith(f"--output {out}: ") and needle in str(err.value), out
    assert tree(tmp_path) == before


# ---- files ------------------------------------------------------------------------------

def _png(path: Path, software: str | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    fig.savefig(path, format="png", metadata={"Software": software} if software else None)
    plt.close(fig)
    return path


def test_file_stamps_are_recognised_and_user_files_are_not(tmp_path):
    ours_json = tmp_path / "r.json"
    ours_json.write_text(json.dumps({"tau": 2.0, STAMP_KEY: o.stamp("eval")}))
    user_json = tmp_path / "u.json"
    user_json.write_text(json.dumps({"tau": 2.0, STAMP_KEY: "forged but not a dict"}))
    assert o.file_stamp(ours_json)["command"] == "eval" and o.file_stamp(user_json) is None
    assert o.file_stamp(_png(tmp_path / "ours.png", o.png_software("eval")))["command"] == "eval"
    assert o.file_stamp(_png(tmp_path / "user.png", None)) is None  # matplotlib's own Software text
    (tmp_path / "cut.png").write_bytes((tmp_path / "ours.png").read_bytes()[:40])
    assert o.file_stamp(tmp_path / "cut.png") is None
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    assert o.file_stamp(tmp_path / "bin") is None


def test_file_outputs_follow_the_same_rules(tmp_path):
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"tau": 1.5, STAMP_KEY: o.stamp("eval")}))
    mine = tmp_path / "mine.json"
    mine.write_text('{"tau": 9}')
    assert plan_output(tmp_path / "new.json", "--json", kind="file").action == o.NEW
    with pytest.raises(OutputError, match=r"--json .*eval\.json: holds an earlier dflash-toolkit output \(eval"):
        plan_output(report, "--json", kind="file")
    assert plan_output(report, "--json", kind="file", overwrite=True).action == o.REPLACE
    with pytest.raises(OutputError, match="not a dflash-toolkit output .*it is never replaced"):
        plan_output(mine, "--json", kind="file", overwrite=True)
    with pytest.raises(OutputError, match="is a folder, not a file"):
        plan_output(tmp_path, "--plot", kind="file", overwrite=True)
    with pytest.raises(OutputError, match="is the source"):
        plan_output(report, "--json", kind="file", sources=[report], overwrite=True)


def test_two_flags_naming_one_file_are_refused(tmp_path):
    with pytest.raises(OutputError, match=r"--plot .*x: --json names the same path"):
        o.check_distinct(("--json", tmp_path / "x"), ("--plot", tmp_path / "sub" / ".." / "x"))
    o.check_distinct(("--json", tmp_path / "x"), ("--plot", None), ("--other", tmp_path / "y"))


# ---- writability and room -----------------------------------------------------------------

def test_unwritable_location_fails_naming_flag_and_path(unwritable_dir):
    out = unwritable_dir / "sub" / "report.json"
    with pytest.raises(OutputError) as err:
        plan_output(out, "--json", kind="file")
    msg = str(err.value)
    assert msg.startswith(f"--json {out}: cannot write in {unwritable_dir}") and "\n" not in msg
    assert not (unwritable_dir / "sub").exists()


def test_path_under_a_regular_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match=r"--output .*f/run: .*f is a file, not a folder"):
        plan_output(tmp_path / "f" / "run", "--output")


def test_not_enough_room_is_refused_before_writing(tmp_path):
    with pytest.raises(OutputError, match=r"--output .*: needs about .* but only .* are free"):
        o.check_writable(tmp_path / "out", "--output", need_bytes=1 << 62)
    o.check_writable(tmp_path / "out", "--output", need_bytes=1 << 20)
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind


def test_a_complete_own_output_may_be_read_only(unwritable_dir):
    """A finished cache in a read-only place is reused: only a write it needs must be possible."""
    assert plan_output(unwritable_dir, "--output", own=True, writable=False).action == o.OWN
    with pytest.raises(OutputError, match="cannot write in"):
        plan_output(unwritable_dir, "--output", own=True)


# ---- --overwrite replaces only what the toolkit wrote (issue 26) ---------------------------

def test_the_marker_lists_the_files_the_toolkit_wrote(tmp_path):
    out = toolkit_folder(tmp_path / "rows")
    (out / "sub").mkdir()
    marker = json.loads((out / MARKER).read_text())
    assert marker["files"] == ["data.bin"] and "in_place" not in marker
    assert o.foreign_files(out) == []


def test_overwrite_refuses_a_folder_holding_files_the_user_added(tmp_path):
    out = toolkit_folder(tmp_path / "rows")
    (out / "analysis.ipynb").write_text("{}")
    (out / "notes").mkdir()
    (out / "notes" / "todo.md").write_text("keep")
    before = tree(tmp_path)
    with pytest.raises(OutputError, match=r"--output .*rows: holds files the toolkit did not write there "
                                          r"\(analysis.ipynb, notes/todo.md\); --overwrite replaces only"):
        with folder_output(out, "--output", "prepare", overwrite=True) as tmp:
            (tmp / "data.bin").write_bytes(b"new")
    assert tree(tmp_path) == before
    (out / "analysis.ipynb").unlink()
    (out / "notes" / "todo.md").unlink()
    with folder_output(out, "--output", "prepare", overwrite=True) as tmp:  # only its own files: replaced
        (tmp / "data.bin").write_bytes(b"new")
    assert (out / "data.bin").read_bytes() == b"new" and not (out / "notes").exists()


def test_a_marker_without_a_file_list_judges_by_age(tmp_path):
    # outputs written before the file list existed: a file newer than the marker was added afterwards
    out = toolkit_folder(tmp_path / "old")
    marker = json.loads((out / MARKER).read_text())
    del marker["files"]
    (out / MARKER).write_text(json.dumps(marker))
    old = (out / MARKER).stat().st_mtime - 60
    os.utime(out / MARKER, (old, old))
    os.utime(out / "data.bin", (old - 1, old - 1))
    assert o.foreign_files(out) == []
    (out / "mine.txt").write_text("added later")
    assert o.foreign_files(out) == ["mine.txt"]
    with pytest.raises(OutputError, match=r"did not write there \(mine.txt\)"):
        plan_output(out, "--output", overwrite=True)


@pytest.mark.parametrize("command", ["train", "features", "demo", "sweep"])
def test_overwrite_never_replaces_a_folder_grown_in_place(tmp_path, command):
    run = tmp_path / "run"
    o.ensure_folder(plan_output(run, "--output", overwrite=None), command)
    (run / "summary.json").write_text("{}")
    assert json.loads((run / MARKER).read_text())["in_place"] is True
    with pytest.raises(OutputError, match=f"OUT {run}: holds an earlier dflash-toolkit output \\({command}, .*"
                                          "grows in place; --overwrite never replaces it"):
        plan_output(run, "OUT", overwrite=True)


def test_a_command_rewriting_its_own_folder_keeps_what_others_added(tmp_path):
    final = toolkit_folder(tmp_path / "final", "train")
    (final / "README.md").write_text("my model card")
    with folder_output(final, "--output", "train", own=True) as tmp:
        (tmp / "data.bin").write_bytes(b"resumed")
    assert (final / "data.bin").read_bytes() == b"resumed" and (final / "README.md").read_text() == "my model card"
    assert json.loads((final / MARKER).read_text())["files"] == ["data.bin"]  # the card is still not the toolkit's


def test_a_disk_that_fills_mid_write_is_one_error_and_leaves_nothing(tmp_path):
    import errno

    def write_until_full(tmp):
        (tmp / "part.bin").write_bytes(b"x" * 5000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputError, match=r"--output .*rows: the disk filled while writing it \(5.0 KB written; "
                                          r".* free now; it needs at least 1.0 MB\); nothing was kept"):
        with folder_output(tmp_path / "rows", "--output", "prepare", need_bytes=10**6) as tmp:
            write_until_full(tmp)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("message", ["[enforce fail at inline_container.cc:664] . unexpected pos 6528 vs 6416",
                                     "Error while serializing: IoError(Os { code: 28, kind: StorageFull })"])
def test_libraries_report_a_full_disk_in_their_own_words(message):
    from dflash_train.errors import is_disk_full

    assert is_disk_full(RuntimeError(message)) and not is_disk_full(RuntimeError("shape mismatch"))


# ---- one writer per output ----------------------------------------------------------------

HOLD = """
import sys, time
from dflash_train.output_lock import output_lock
with output_lock(sys.argv[1], "--output", "train"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_a_second_writer_is_refused_naming_the_owner(tmp_path):
    import socket
    import subprocess
    import sys

    from dflash_train.output_lock import lock_path, output_lock

    out = tmp_path / "runs" / "r1"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputError, match=f"--output {out}: another command is writing it \\(train, pid "
                                              f"{holder.pid} on {socket.gethostname()}, since .*\\); wait for it"):
            with output_lock(out, "--output", "prepare"):
                pass
    finally:
        holder.kill()
        holder.wait()
    assert lock_path(out).exists()  # killed: the file stays, but the kernel released the lock
    with output_lock(out, "--output", "prepare"):  # so it is stale, and taken over
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    assert not lock_path(out).exists()
    fresh = tmp_path / "new" / "deeper" / "r2"
    with output_lock(fresh, "--output", "prepare"):
        assert lock_path(fresh).is_file()
    assert not (tmp_path / "new").exists()  # the folders the lock made for itself are gone with it


def test_without_flock_a_dead_owners_lock_is_stale(tmp_path, monkeypatch):
    import fcntl
    import socket

    from dflash_train.output_lock import lock_path, output_lock

    def no_flock(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "rows"
    lock_path(out).write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname(), "command": "prepare"}))
    with output_lock(out, "--output", "prepare"):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
        with pytest.raises(OutputError, match=f"another command is writing it \\(prepare, pid {os.getpid()}"):
            with output_lock(out, "--output", "prepare"):
                pass
    assert not lock_path(out).exists()


def test_a_shared_cache_entry_waits_for_its_builder(tmp_path, capsys):
    import subprocess
    import sys
    import time

    from dflash_train.output_lock import lock_path, output_lock

    entry = tmp_path / "cache" / "abc123"
    hold = HOLD.replace("time.sleep(60)", "time.sleep(2)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(entry)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    with output_lock(entry, "the data cache", "train", wait=True):
        waited = time.monotonic() - started  # the builder held it ~2 s
        assert json.loads(lock_path(entry).read_text())["pid"] == os.getpid()
    holder.wait()
    assert waited > 1.0 and not lock_path(entry).exists()
    assert f"the data cache {entry}: waiting for train, pid {holder.pid}" in capsys.readouterr().err


def test_a_signal_between_the_two_renames_of_a_replace_waits_for_the_second(tmp_path, monkeypatch):
    """Replacing an output is two renames (old aside, new in); a Ctrl-C after the first is held until
    the second is done, then raised as usual: `out` is never missing, and the old folder is gone."""
    import signal

    from dflash_train import outputs
    from dflash_train.errors import Stopped, _stop

    out, tmp = tmp_path / "out", tmp_path / ".tmp-out"
    out.mkdir()
    (out / "a.txt").write_text("old")
    tmp.mkdir()
    (tmp / "a.txt").write_text("new")
    real, seen = os.rename, []

    def rename(a, b):
        real(a, b)
        seen.append(Path(b).name)
        if len(seen) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # held: no handler runs before the second rename

    monkeypatch.setattr(outputs.os, "rename", rename)
    import threading  # a thread that leaves signals unblocked: the kernel may hand it the SIGINT

    idle = threading.Event()
    threading.Thread(target=idle.wait, args=(5,), daemon=True).start()
    previous = signal.signal(signal.SIGINT, _stop)
    try:
        with pytest.raises(Stopped):
            outputs.install_folder(tmp, out, replace_ok=True)
    finally:
        signal.signal(signal.SIGINT, previous)
        idle.set()
    assert seen[1] == "out" and (out / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old folder removed all the same


def test_a_lock_folder_removed_by_its_last_owner_meanwhile_is_made_again(tmp_path, monkeypatch):
    """The owner that made the entry's folder removes it as it ends: a waiter's mkdir or open can meet that
    race (CI, once). It must take the lock anyway, not run without one."""
    from dflash_train.output_lock import lock_path, output_lock

    entry = tmp_path / "cache" / "abc123"
    real_mkdir, raced = Path.mkdir, []

    def racing_mkdir(self, *args, **kwargs):
        if not raced:  # as pathlib raises when the folder went between its two checks
            raced.append(self)
            raise FileExistsError(17, "File exists", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    with output_lock(entry, "the data cache", "train", wait=True):
        assert raced and json.loads(lock_path(entry).read_text())["pid"] == os.getpid()
    assert not lock_path(entry).exists()
