"""Small helpers shared by the data modules."""


def one_line(error: BaseException) -> str:
    """'TypeName: first line of the message', for wrapping a library's exception in a one-line UserError."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
