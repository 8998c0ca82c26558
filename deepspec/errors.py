"""The one exception the user sees: a one-line message, no traceback."""


class DeepSpecError(Exception):
    """A user-facing error (bad input, missing file, invalid config): the CLI
    prints it as one line naming the file, line or key, and exits with 2."""
