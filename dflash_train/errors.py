"""The toolkit's one exception family.

Every message names the file, field or flag at fault and says what to do. The CLIs print
these without a traceback and exit with code 2; anything else is a bug and keeps its trace.
"""


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


def run_cli(app) -> None:
    """Run a CLI app; a DFlashError becomes one line on stderr and exit code 2, no traceback."""
    import sys

    try:
        app()
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
