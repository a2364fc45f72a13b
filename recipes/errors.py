"""The one exception type for mistakes a user can make (bad recipe, missing file, unreachable host).

The CLI prints its message without a traceback and exits non-zero; anything else is a bug and keeps
its traceback. It lives at the bottom of the import graph so every layer can raise it.
"""


class UserError(Exception):
    """A problem the user can fix; `str(error)` is the whole message shown to them."""

    exit_code = 2


class RunFailed(UserError):
    """A run stopped on something that is not the user's doing (a bug, a crashed process): the message is the few
    lines that explain it and the log that holds the rest; `--debug` shows the traceback."""

    exit_code = 1
