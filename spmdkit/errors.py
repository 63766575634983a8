"""The one exception type users see, and the one warning type.

Every error a user can cause (a bad mesh string, sizes that don't divide, an unknown preset, a damaged
checkpoint, unreadable data) raises `SpmdkitError` with a one-line message saying what was wrong and how
to fix it. The CLI prints that line and exits non-zero without a traceback. `SpmdkitWarning`s are printed as
one line each too.
"""


class SpmdkitError(Exception):
    """A problem with the user's input or environment, described in one line."""


class SpmdkitWarning(UserWarning):
    """Something the user should know that does not stop the run (e.g. a damaged checkpoint step was skipped); the
    CLI prints it as one line, `spmdkit: warning: ...`."""
