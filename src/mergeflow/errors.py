"""One exception type for every user-facing failure: the CLI prints its message on one line and exits non-zero."""


class MergeflowError(Exception):
    """Bad input or configuration. The message names the file, key or tensor at fault."""
