"""User-facing errors: one line, no traceback, non-zero exit (see `hpsearch.cli.run_main`)."""


class UserError(Exception):
    """A mistake in the user's input (config, override, data). Printed as one line, exit code 2."""


class ConfigError(UserError):
    """A bad config file, override key or value."""


class DataError(UserError):
    """A missing folder/file/split, a malformed data row, an unknown task."""


def disk_full(e: BaseException) -> bool:
    """An error that means the device is full: ENOSPC; safetensors' "os error 28"; torch.save's message when
    a write came up short ("unexpected pos")."""
    import errno
    text = str(e)
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in text \
        or "os error 28" in text or "unexpected pos" in text
