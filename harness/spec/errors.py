"""The project's one exception type for user-facing errors."""


class HarnessError(Exception):
    """A problem the user can fix: bad config, unknown backend, missing file.

    The message is complete and actionable on its own; the CLI prints it as
    ``error: <message>`` and exits with a non-zero code, never a traceback.
    """
