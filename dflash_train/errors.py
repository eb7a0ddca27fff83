"""The toolkit's one exception family.

Every message names the file, field or flag at fault and says what to do. The CLIs print
these without a traceback and exit with code 2; anything else is a bug and keeps its trace.
"""

import os
from contextlib import contextmanager


class DFlashError(Exception):
    """A user-facing error: bad input, a bad checkpoint, a missing optional dependency."""


class ConfigError(DFlashError):
    """A recipe, config.json or CLI flag holds a value the toolkit cannot use."""


class CheckpointError(DFlashError):
    """A checkpoint folder is missing files, has unknown tensors or disagrees with its config."""


class DataError(DFlashError):
    """A dataset, feature shard or manifest cannot be used as given."""


class OutputError(DFlashError):
    """An output path the toolkit must not write: it exists, holds a source, or has no room."""


class MissingDependencyError(DFlashError):
    """An optional package (vllm, sglang, ...) is needed for this command but not installed."""


class TrainingError(DFlashError):
    """Training stopped: the loss, the gradients or the weights are no longer finite."""


def is_disk_full(exc: BaseException) -> bool:
    """A full disk, however the writer says it: an OSError (ENOSPC, EDQUOT), torch.save's stream
    writer (RuntimeError "unexpected pos" / "file write failed"), safetensors' error (os error 28)."""
    import errno

    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return any(s in text for s in ("No space left", "unexpected pos", "file write failed", "os error 28",
                                   "code: 28", "Disk quota exceeded"))


def os_error_line(exc: OSError) -> str:
    """One line for a failed file operation: the file, what went wrong, what to do."""
    import errno

    what = exc.strerror or type(exc).__name__
    hint = {errno.EACCES: "check its permissions", errno.EPERM: "check its permissions",
            errno.ENOSPC: "free some space", errno.EDQUOT: "free some space", errno.EROFS: "choose a writable place",
            errno.EISDIR: "give a file, not a folder", errno.ENOTDIR: "a part of the path is a file, not a folder",
            errno.ENOENT: "check the path"}.get(exc.errno, "check the path and try again")
    return f"{exc.filename}: {what}; {hint}"


class Stopped(BaseException):
    """SIGTERM, SIGHUP or Ctrl-C (SIGINT) arrived: raised in the main thread so every `finally` (temp folders, locks,
    engine workers) runs, as it does for Ctrl-C. A BaseException, so no `except Exception` eats it."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame) -> None:
    import signal

    signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once
    raise Stopped(signum)


def run_cli(app) -> None:
    """Run a CLI app; a DFlashError becomes one line on stderr and exit code 2, no traceback.

    An OSError that names a file (permissions, a full disk, a folder where a file was expected)
    is the user's to fix and is rendered the same way, and so is a full disk anywhere; SIGTERM,
    SIGHUP and Ctrl-C clean up (temp folders, locks) and end with one line and exit 128 + the signal. Every other exception
    is a bug and keeps its traceback."""
    import signal
    import sys

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        try:
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's ignored SIGHUP stays ignored
                signal.signal(signum, _stop)
        except (ValueError, OSError):  # not the main thread (an embedding caller): leave theirs
            pass
    try:
        app()
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except Stopped as exc:
        print(f"error: stopped by {exc}; temporary files were removed (a resumable command continues where it "
              "stopped when run again)", file=sys.stderr)
        raise SystemExit(128 + exc.signum) from None
    except OSError as exc:
        if exc.filename is None and not is_disk_full(exc):
            raise
        line = os_error_line(exc) if exc.filename is not None else f"the disk is full ({exc.strerror}); free some space"
        print(f"error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as exc:  # a library's own words for a full disk (torch.save, safetensors)
        if not is_disk_full(exc):
            raise
        print(f"error: the disk is full ({type(exc).__name__}: {str(exc)[:160]}); free some space and run the "
              "command again", file=sys.stderr)
        raise SystemExit(2) from None


@contextmanager
def signals_held():
    """Hold SIGINT, SIGTERM and SIGHUP for a step that must not be cut in two: one that arrives meanwhile is
    noted, and its handler (errors.Stopped) runs as the block ends. Held at Python's level, not with a
    signal mask: the kernel may hand a signal to any thread, but Python runs its handlers in the main
    thread. Off the main thread, where no handler can be set, a no-op."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s in previous:
        signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])  # the default action, now that the step is done
