"""The one exception the user sees: a one-line message, no traceback."""


class DeepSpecError(Exception):
    """A user-facing error (bad input, missing file, invalid config): the CLI
    prints it as one line naming the file, line or key, and exits with 2."""


def first_line(e: BaseException) -> str:
    """The first line of another library's error (its type's name when it says nothing),
    for a one-line DeepSpecError that wraps it."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
