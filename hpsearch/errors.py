"""User-facing errors: one line, no traceback, non-zero exit (see `hpsearch.cli.run_main`)."""


class UserError(Exception):
    """A mistake in the user's input (config, override, data). Printed as one line, exit code 2."""


class ConfigError(UserError):
    """A bad config file, override key or value."""


class DataError(UserError):
    """A missing folder/file/split, a malformed data row, an unknown task."""
