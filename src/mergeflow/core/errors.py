"""The user-facing failures and the exit status each gives (the CLI prints the message on one line).

Exit status 2 is bad input or configuration: running again cannot help, so the Prefect flow never retries it.
Exit status 75 (EX_TEMPFAIL) is a transient failure of the environment, which a retry may get past.
"""

BAD_INPUT_STATUS = 2
TRANSIENT_STATUS = 75


class MergeflowError(Exception):
    """Bad input or configuration. The message names the file, key or tensor at fault."""

    exit_status = BAD_INPUT_STATUS


class TransientError(MergeflowError):
    """A failure a retry may get past: a lock held by another process, a busy database, memory taken by others."""

    exit_status = TRANSIENT_STATUS


def first_line(err: object, empty: str = "") -> str:
    """The first line of an error's text (a library's own may run to ten), or ``empty`` when it has none."""
    return (str(err).strip().splitlines() or [empty])[0]


def did_you_mean(name: object, names: list[str]) -> str:
    """'did you mean ties, lines? ' for the names closest to ``name`` (difflib's ratio, at most three), or '': a
    refusal shows these instead of every name, which it leaves to the command that lists them."""
    import difflib

    close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
    return f"did you mean {', '.join(close)}? " if close else ""
