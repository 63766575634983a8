"""The one exception type users see.

Every error a user can cause (a bad mesh string, sizes that don't divide, an unknown preset, a damaged
checkpoint, unreadable data) raises `SpmdkitError` with a one-line message saying what was wrong and how
to fix it. The CLI prints that line and exits non-zero without a traceback.
"""


class SpmdkitError(Exception):
    """A problem with the user's input or environment, described in one line."""
