"""Where the toolkit writes: one policy for every command's outputs.

- A path that does not exist yet is written; its parents are created.
- A path that exists is refused, with a message naming it, unless it is
  - the command's own resumable output (the caller recognises it: a run folder on --resume,
    a feature cache or a prepared folder of the same inputs), or
  - an empty folder, or
  - an earlier toolkit output and `--overwrite` was given: a folder holding the marker file
    `.dflash-output.json`, or a JSON / PNG file carrying the toolkit's stamp.
  A folder or file the toolkit did not write is never replaced, `--overwrite` or not. Nor is a
  file someone added to a toolkit folder afterwards: the marker lists the files the toolkit wrote,
  and `--overwrite` on a folder holding others is refused, naming them. A folder a command grows in
  place (a training run, a feature cache, a demo or sweep folder) is never replaced by another
  command's `--overwrite`.
- A path that holds a source (equals it, lies inside it or contains it), `/`, the home folder,
  the current folder and any folder containing those are refused outright.
- The location must be writable and have room for the output before the work starts.

Folders are written into a temp folder beside the output and renamed into place; a replaced
folder is moved aside first and deleted only after its marker was checked once more.

One command at a time writes an output: see `dflash_train.output_lock`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash_train.errors import OutputError, is_disk_full, signals_held

MARKER = ".dflash-output.json"
STAMP_KEY = "dflash_output"  # the stamp inside JSON files the toolkit writes
TOOL = "dflash-toolkit"

NEW, EMPTY, REPLACE, OWN = "new", "empty", "replace", "own"
# commands whose output folder grows in place (no file list in their marker): never another's --overwrite
IN_PLACE_COMMANDS = ("train", "features", "demo", "sweep")


@dataclass(frozen=True)
class OutputPlan:
    """What writing `path` will do: create it (new), fill an empty folder (empty), replace an
    earlier toolkit output (replace) or continue the command's own output in place (own)."""

    path: Path
    flag: str
    action: str


# ---- stamps -----------------------------------------------------------------------------

def stamp(command: str) -> dict:
    """Who wrote an output and when: the JSON stamp, and the core of the marker file."""
    try:
        from importlib.metadata import version

        ver = version(TOOL)
    except Exception:  # running from a source tree that was never installed
        ver = "unknown"
    return {"tool": TOOL, "version": ver, "command": command,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def png_software(command: str) -> str:
    """The PNG `Software` text the toolkit's plots carry (matplotlib `metadata=`)."""
    return f"{TOOL} {command}"


def folder_stamp(path: str | Path) -> dict | None:
    """The marker of a folder the toolkit wrote, else None."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        return None
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == TOOL else None


def _files_under(folder: Path) -> list[str]:
    """Every file (and link) under `folder`, as relative POSIX paths, the marker excluded."""
    found = []
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = Path(root, name).relative_to(folder).as_posix()
            if rel != MARKER:
                found.append(rel)
    return sorted(found)


def foreign_files(folder: str | Path, st: dict | None = None) -> list[str]:
    """Files in a toolkit folder that the toolkit did not write there: those missing from the file
    list of its marker; for a marker written before the list existed, those newer than the marker."""
    folder = Path(folder)
    st = st if st is not None else folder_stamp(folder)
    if st is None:
        return _files_under(folder)
    listed = st.get("files")
    if isinstance(listed, list):
        known = set(map(str, listed))
        return [f for f in _files_under(folder) if f not in known]
    try:
        marked = (folder / MARKER).stat().st_mtime
    except OSError:
        return _files_under(folder)
    return [f for f in _files_under(folder) if (folder / f).lstat().st_mtime > marked + 2.0]


def grows_in_place(st: dict | None) -> bool:
    """A folder a command fills in place (a run, a cache): only that command continues it."""
    return bool(st) and (bool(st.get("in_place")) or st.get("command") in IN_PLACE_COMMANDS)


def _named(files: list[str], most: int = 4) -> str:
    shown = ", ".join(files[:most])
    return shown + (f" and {len(files) - most} more" if len(files) > most else "")


def file_stamp(path: str | Path) -> dict | None:
    """The stamp of a JSON or PNG file the toolkit wrote, else None (any other file)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        size = path.stat().st_size
    except OSError:
        return None
    if head.startswith(b"\x89PNG"):
        from PIL import Image

        try:
            with Image.open(path) as im:
                software = im.info.get("Software", "")
        except Exception:  # Pillow raises many types for a damaged image: then it is not ours
            return None
        if isinstance(software, str) and software.startswith(TOOL + " "):
            return {"tool": TOOL, "command": software[len(TOOL) + 1:]}
        return None
    if size > 256 * 1024**2:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    found = data.get(STAMP_KEY) if isinstance(data, dict) else None
    return found if isinstance(found, dict) and found.get("tool") == TOOL else None


# ---- the policy -------------------------------------------------------------------------

def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _holds(outer: Path, inner: Path) -> bool:
    return outer == inner or outer in inner.parents


def _describe(st: dict | None) -> str:
    if not st:
        return "an earlier dflash-toolkit output"
    return f"an earlier dflash-toolkit output ({st.get('command', '?')}, {st.get('created', 'unknown time')})"


def check_places(path: Path, flag: str, sources: Iterable) -> None:
    """Refuse /, home, the current folder, their parents, and anything holding a source."""
    real = _real(path)
    home, cwd = _real(Path.home()), _real(Path.cwd())
    named = {Path("/"): "the filesystem root", home: "your home folder", cwd: "the current folder"}
    for place, what in named.items():
        if real == place:
            raise OutputError(f"{flag} {path}: is {what}; the toolkit never writes over it. Name a new "
                              f"subfolder instead, e.g. {flag} {Path(path) / 'out'}")
    for place, what in ((cwd, "the current folder"), (home, "your home folder")):
        if _holds(real, place):
            raise OutputError(f"{flag} {path}: contains {what} ({place}); name a new folder elsewhere")
    for src in sources:
        if src is None or str(src) == "":
            continue
        sp = Path(src)
        if not (sp.exists() or sp.is_symlink()):
            continue  # a hub id or a path that does not exist holds nothing to lose
        sreal = _real(sp)
        if real == sreal:
            raise OutputError(f"{flag} {path}: is the source {src}; the toolkit never writes over its input. "
                              "Choose a new output path")
        if _holds(real, sreal):
            raise OutputError(f"{flag} {path}: contains the source {src}; writing there could destroy it. "
                              "Choose an output path outside it")
        if _holds(sreal, real):
            raise OutputError(f"{flag} {path}: lies inside the source {src}; writing there could destroy it. "
                              "Choose an output path outside it")


def _nearest_existing(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not (p.exists() or p.is_symlink()):
        p = p.parent
    return p


def check_writable(path: str | Path, flag: str, need_bytes: int = 0, *, inside: bool = False) -> None:
    """Raise unless files can be created where `path` goes (inside it when `inside`) and the disk
    has `need_bytes` free. A real temp file is created and removed: permission bits lie to root."""
    path = Path(path)
    where = path if inside else _nearest_existing(Path(os.path.abspath(path)).parent)
    if not where.is_dir():
        raise OutputError(f"{flag} {path}: {where} is a file, not a folder; choose a path under a folder")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot write in {where} ({exc.strerror or exc}); choose a writable "
                          "location") from None
    if need_bytes > 0:
        free = shutil.disk_usage(where).free
        if free < need_bytes:
            raise OutputError(f"{flag} {path}: needs about {_size(need_bytes)} but only {_size(free)} are free "
                              f"on the disk holding {where}; free space or choose another location")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def plan_output(path: str | Path, flag: str, *, kind: str = "folder", sources: Iterable = (), own: bool = False,
                overwrite: bool | None = False, need_bytes: int = 0, writable: bool = True) -> OutputPlan:
    """Decide whether `path` may be written, or raise OutputError naming it.

    `own`: the caller recognised `path` as this command's own resumable output.
    `overwrite`: the user's --overwrite; None where the command has no such flag.
    `writable=False` skips the write probe: an own output that is complete is only read.
    """
    if kind not in ("folder", "file"):
        raise ValueError(f"kind must be folder or file, not {kind!r}")
    path = Path(path)
    check_places(path, flag, sources)
    hint = " or pass --overwrite to replace it" if overwrite is not None else ""
    if path.is_symlink():
        raise OutputError(f"{flag} {path}: is a symbolic link; the toolkit does not write through links. "
                          "Name the real location or a new path")
    if not path.exists():
        action = NEW
    elif kind == "folder":
        if not path.is_dir():
            raise OutputError(f"{flag} {path}: is a file, not a folder; it is never replaced. Choose a new path")
        st = folder_stamp(path)
        if own:
            action = OWN
        elif not any(path.iterdir()):
            action = EMPTY
        elif st is None:
            raise OutputError(f"{flag} {path}: folder exists and is not a dflash-toolkit output (no {MARKER} "
                              "inside); it is never replaced, --overwrite or not. Choose a new path")
        elif overwrite:
            if grows_in_place(st):
                raise OutputError(f"{flag} {path}: holds {_describe(st)}, a folder that command grows in place; "
                                  "--overwrite never replaces it. Choose a new path (or delete it yourself)")
            extra = foreign_files(path, st)
            if extra:
                raise OutputError(f"{flag} {path}: holds files the toolkit did not write there ({_named(extra)}); "
                                  "--overwrite replaces only the toolkit's own files. Move them out or choose a "
                                  "new path")
            action = REPLACE
        else:
            raise OutputError(f"{flag} {path}: holds {_describe(st)}; choose a new path{hint}")
    else:
        if path.is_dir():
            raise OutputError(f"{flag} {path}: is a folder, not a file; choose a file path")
        st = file_stamp(path)
        if own and st is not None:
            action = REPLACE
        elif st is None:
            raise OutputError(f"{flag} {path}: file exists and is not a dflash-toolkit output (it carries no "
                              "dflash-toolkit stamp); it is never replaced, --overwrite or not. Choose a new path")
        elif overwrite:
            action = REPLACE
        else:
            raise OutputError(f"{flag} {path}: holds {_describe(st)}; choose a new path{hint}")
    if writable:
        check_writable(path, flag, need_bytes, inside=action == OWN)
    return OutputPlan(path, flag, action)


def check_distinct(*named: tuple[str, str | Path | None]) -> None:
    """Two flags of one command must not name the same output."""
    seen: dict[Path, str] = {}
    for flag, p in named:
        if p is None:
            continue
        real = _real(Path(p))
        if real in seen:
            raise OutputError(f"{flag} {p}: {seen[real]} names the same path; give each output its own path")
        seen[real] = flag


# ---- writing ----------------------------------------------------------------------------

def write_marker(folder: str | Path, command: str, *, in_place: bool = False) -> None:
    """Mark `folder` as written by the toolkit (temp file + rename). A finished folder's marker lists
    its files (what `--overwrite` may replace); one that grows in place says so instead."""
    folder = Path(folder)
    data = stamp(command)
    if in_place:
        data["in_place"] = True
    else:
        data["files"] = _files_under(folder)
    tmp = folder / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, folder / MARKER)


def ensure_folder(plan: OutputPlan, command: str) -> Path:
    """Create (or keep) a folder that a command fills in place, and mark it."""
    plan.path.mkdir(parents=True, exist_ok=True)
    if folder_stamp(plan.path) is None:
        write_marker(plan.path, command, in_place=True)
    return plan.path


def install_folder(tmp: Path, out: Path, *, replace_ok: bool) -> None:
    """Rename the finished `tmp` to `out`. An existing `out` is moved aside first and deleted only
    when `replace_ok` (the caller checked it is the toolkit's); an empty folder is simply taken over."""
    tmp, out = Path(tmp), Path(out)
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        os.rename(tmp, out)  # POSIX rename replaces an empty folder in one step
        return
    if not replace_ok:
        raise OutputError(f"{out}: appeared while the output was being written; nothing was replaced. "
                          "Move it away or choose a new path, and retry")
    old = out.with_name(f".old-{out.name}-{os.getpid()}")
    try:
        with signals_held():  # a Ctrl-C between the two renames would leave neither folder at `out`
            os.rename(out, old)
            os.rename(tmp, out)
    finally:  # also when a signal held meanwhile is raised as the block ends
        if not old.exists() or out.exists():
            shutil.rmtree(old, ignore_errors=True)


@contextmanager
def folder_output(path: str | Path, flag: str, command: str, *, sources: Iterable = (), own: bool = False,
                  overwrite: bool | None = False, need_bytes: int = 0) -> Iterator[Path]:
    """Yield a temp folder beside `path`; when the block succeeds it is marked and renamed to `path`
    (replacing it only as `plan_output` allows). On failure nothing at `path` changes."""
    plan = plan_output(path, flag, sources=list(sources), own=own, overwrite=overwrite, need_bytes=need_bytes)
    out = plan.path
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        try:
            yield tmp
            write_marker(tmp, command)  # lists the files written: what others added is carried after it
            if plan.action == OWN and out.is_dir():
                _carry_foreign(out, tmp)
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            raise disk_full(out, flag, tmp, need_bytes) from None
        if plan.action == REPLACE and folder_stamp(out) is None:
            raise OutputError(f"{flag} {out}: its {MARKER} vanished while writing; nothing was replaced")
        install_folder(tmp, out, replace_ok=plan.action in (REPLACE, OWN))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)  # our own temp folder, never a user path


def _carry_foreign(out: Path, tmp: Path) -> None:
    """A command rewriting its own folder (a run's final/) keeps what others added there."""
    st = folder_stamp(out)
    for rel in foreign_files(out, st) if st is not None else []:
        if not (tmp / rel).exists():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / rel, tmp / rel, follow_symlinks=False)


def no_room(path: str | Path) -> bool:
    """The disk holding `path` is full now: under 1 MiB free, or no free inodes (files) left. Right after a
    failed write, that makes the failure a full disk whatever words the writer used (DeepSpeed's lost mkdir
    reaches torch as "Parent directory ... does not exist")."""
    vfs = os.statvfs(_nearest_existing(Path(os.path.abspath(path))))
    return (vfs.f_files > 0 and vfs.f_favail == 0) or vfs.f_bavail * vfs.f_frsize < (1 << 20)


def folder_size(path: str | Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def disk_full(out: Path, flag: str, partial: Path | None = None, need_bytes: int = 0) -> OutputError:
    """The one-line error for a disk that filled while `out` was written (the partial files are the
    caller's to remove; it names what was written, what the disk has free and what to do)."""
    written = folder_size(partial) if partial is not None and Path(partial).exists() else 0
    where = _nearest_existing(Path(os.path.abspath(out)))
    free = shutil.disk_usage(where).free
    need = max(need_bytes, written)
    vfs = os.statvfs(where)
    files_left = "" if vfs.f_files == 0 or vfs.f_favail > 16 else f", {vfs.f_favail} free inodes (files)"
    return OutputError(f"{flag} {out}: the disk filled while writing it ({_size(written)} written; {_size(free)} "
                       f"free now{files_left}; it needs at least {_size(need)}); nothing was kept. Free space or "
                       "choose another location, and run the command again")


def discard_folder(path: str | Path) -> bool:
    """Delete a scratch folder the toolkit made (it carries the marker); leave anything else."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir() or folder_stamp(path) is None:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
