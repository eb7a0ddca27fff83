"""One command at a time writes an output.

`output_lock` holds a lock file beside the output (`.NAME.dflash-lock`, holding the owner's pid,
host, command and start time) for the whole command, taken before anything is written, so a second
command on the same output is refused at once with one line naming the owner. The lock is an
flock: the kernel releases it when its owner dies, so a file left by a killed command is stale and
simply taken over. Where a filesystem has no flock, the file is created exclusively and a file whose
pid is dead on this host is stale.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_train.errors import OutputError
from dflash_train.outputs import TOOL, check_places

LOCK_SUFFIX = ".dflash-lock"


def lock_path(path: str | Path) -> Path:
    path = Path(os.path.abspath(path))
    return path.with_name(f".{path.name}{LOCK_SUFFIX}")


def _owner(lock: Path) -> str:
    try:
        data = json.loads(lock.read_text())
        return (f"{data.get('command', 'a dflash-toolkit command')}, pid {data.get('pid', '?')} on "
                f"{data.get('host', '?')}, since {data.get('started', '?')}")
    except (OSError, ValueError, AttributeError):
        return "another dflash-toolkit command"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def output_lock(path: str | Path | None, flag: str, command: str, *, wait: bool = False) -> Iterator[None]:
    """Hold the lock on output `path` for the block: a second command on it is refused at once with an
    OutputError naming the owner (pid, host, command), or with `wait` (a shared cache entry, which the
    owner is building for both) waits for it, saying so once on stderr. Ranks other than 0 of a
    distributed launch take no lock (rank 0 holds it for the run). Where no lock file can be made (a
    read-only place) the command's own checks give the error, so no lock is taken."""
    import fcntl
    import socket

    if path is None or os.environ.get("RANK", "0") != "0":
        yield
        return
    path = Path(path)
    check_places(path, flag, ())
    lock = lock_path(path)
    made = []  # parent folders this lock created: removed again when they stay empty
    p = lock.parent
    while not p.exists():
        made.append(p)
        p = p.parent
    fd, races = None, 0
    try:
        while fd is None:
            try:
                lock.parent.mkdir(parents=True, exist_ok=True)  # again: a previous owner may have removed it
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                # the previous owner removed the folder it made between mkdir's checks, or between the mkdir and
                # the open: again (seen once in CI, where the lock was then taken as impossible and skipped)
                if isinstance(exc, (FileExistsError, FileNotFoundError)) and races < 50:
                    races += 1
                    continue
                yield  # no lock file possible here: the command's own write checks refuse it
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if wait:
                    print(f"{flag} {path}: waiting for {_owner(lock)} to finish writing it", file=sys.stderr)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                else:
                    os.close(fd)
                    fd = None  # not ours: the owner's lock file stays
                    raise OutputError(f"{flag} {path}: another command is writing it ({_owner(lock)}); wait for it "
                                      f"to finish or stop it, then retry (lock: {lock})") from None
            except OSError:  # no flock on this filesystem: the pid in the file decides
                os.close(fd)
                fd = None
                fd = _exclusive_lock(lock, flag, path)
                break
            try:
                same = os.fstat(fd).st_ino == os.stat(lock).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous owner removed it between our open and lock: take a fresh one
                os.close(fd)
                fd = None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"tool": TOOL, "pid": os.getpid(), "host": socket.gethostname(), "command": command,
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode())
        yield
    finally:
        if fd is not None:
            try:
                os.unlink(lock)
            except OSError:
                pass
            os.close(fd)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break


def _exclusive_lock(lock: Path, flag: str, path: Path) -> int:
    """A lock without flock: create the file exclusively; one whose pid is dead on this host is stale."""
    import socket

    for _ in range(3):
        try:
            return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                data = json.loads(lock.read_text())
            except (OSError, ValueError):
                data = {}
            if data.get("host") == socket.gethostname() and isinstance(data.get("pid"), int) \
                    and not _alive(data["pid"]):
                lock.unlink(missing_ok=True)  # stale: its owner is gone
                continue
            raise OutputError(f"{flag} {path}: another command is writing it ({_owner(lock)}); wait for it to "
                              f"finish or stop it, then retry (if it is gone, delete {lock})") from None
    raise OutputError(f"{flag} {path}: could not take its lock {lock}; retry")
