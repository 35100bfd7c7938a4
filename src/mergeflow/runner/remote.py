"""The DVC remote a run's outputs travel by: set up in one command (`mergeflow remote add URL`), pushed by
`dvc push` or by the Prefect flow after a run that produced something, restored on a fresh clone by `dvc pull`.

The remote goes into .dvc/config, which git tracks, so a clone knows where to pull from; its credentials never
do. S3's come from the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) or from
`dvc remote modify --local`, which writes the git-ignored .dvc/config.local."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from mergeflow.core.errors import MergeflowError, first_line

DEFAULT_NAME = "storage"
NAME = re.compile(r"[A-Za-z0-9_.-]+")
# URL scheme -> the DVC plugin that reads it (local folders need none); mergeflow installs dvc-s3
PLUGINS = {
    "s3": "dvc_s3",
    "gs": "dvc_gs",
    "azure": "dvc_azure",
    "ssh": "dvc_ssh",
    "http": "dvc_http",
    "https": "dvc_http",
    "webdav": "dvc_webdav",
    "hdfs": "dvc_hdfs",
}


@dataclass(frozen=True)
class Remote:
    name: str
    url: str

    def __str__(self) -> str:
        return f"{self.name} ({self.url})"


def _no_password(url: str, what: str) -> None:
    parts = urlsplit(url)
    if parts.password:
        raise MergeflowError(
            f"{what} {parts.scheme}://{parts.hostname}...: has a password, which would go into .dvc/config (tracked by "
            "git); give credentials in the environment or with `dvc remote modify --local`"
        )


def check_url(url: str) -> str:
    """The scheme of a remote URL ("" for a local folder), or a one-line error: an unknown scheme, a plugin that
    is not installed, or a password in the URL (it would be committed with .dvc/config)."""
    _no_password(url, "remote URL")
    parts = urlsplit(url)
    scheme = parts.scheme if len(parts.scheme) > 1 else ""  # a one-letter scheme is a Windows drive
    if scheme and scheme not in PLUGINS:
        raise MergeflowError(
            f"remote URL {url}: unknown scheme {scheme!r}; use a folder, or one of {', '.join(sorted(PLUGINS))}"
        )
    if scheme and importlib.util.find_spec(PLUGINS[scheme]) is None:
        raise MergeflowError(
            f"remote URL {url}: {scheme} needs DVC's plugin {PLUGINS[scheme].replace('_', '-')} (pip install "
            f"{PLUGINS[scheme].replace('_', '-')})"
        )
    return scheme


@contextlib.contextmanager
def _dvc_repo(root: str | Path):
    """The DVC repository at ``root``; DVC's errors (not a repository, a config it cannot read) as one line."""
    from dvc.exceptions import DvcException, NotDvcRepoError
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            yield repo
    except NotDvcRepoError:
        raise MergeflowError(
            f"{Path(root).resolve()}: not a DVC repository (run this from the repository root)"
        ) from None
    except DvcException as err:
        raise MergeflowError(
            f"{Path(root) / '.dvc' / 'config'}: {(str(err).splitlines() or ['DVC failed'])[0]}"
        ) from None


def add_remote(url: str, name: str = DEFAULT_NAME, endpoint_url: str | None = None, root: str | Path = ".") -> Remote:
    """Make ``url`` the project's default DVC remote, in .dvc/config. A local folder is kept as an absolute
    path (DVC would otherwise store it relative to .dvc/); ``endpoint_url`` points S3 at an S3-compatible server
    (MinIO, Ceph, moto)."""
    if not NAME.fullmatch(name):
        raise MergeflowError(f"--name {name!r}: a remote's name is a plain word (letters, digits, _ . -)")
    scheme = check_url(url)
    if endpoint_url:
        _no_password(endpoint_url, "--endpoint-url")
        if scheme != "s3":
            raise MergeflowError(f"--endpoint-url {endpoint_url}: only an s3:// remote has an endpoint, not {url}")
    if not scheme:
        url = os.path.abspath(os.path.expanduser(url))
    with _dvc_repo(root) as repo, repo.config.edit("repo") as conf:
        conf["remote"][name] = {"url": url} | ({"endpointurl": endpoint_url} if endpoint_url else {})
        conf["core"]["remote"] = name
    return Remote(name, url)


def default_remote(root: str | Path = ".", committed_only: bool = False) -> Remote | None:
    """The project's default DVC remote (core.remote, from any config level), or None when there is none. With
    ``committed_only``, only what .dvc/config itself says: a clone has no .dvc/config.local, nor this user's."""
    with _dvc_repo(root) as repo:
        conf = repo.config.load_one("repo") if committed_only else repo.config
        name = conf.get("core", {}).get("remote")
        if not name:
            return None
        url = conf.get("remote", {}).get(name, {}).get("url")
        if not url:
            raise MergeflowError(
                f".dvc/config: core.remote names {name!r}, which no [remote] section with a url defines"
            )
        return Remote(name, url)


def push_outputs(root: str | Path = ".", jobs: int | None = None, remote: Remote | None = None) -> int:
    """`dvc push`: every cached output dvc.lock records, to the default remote (``remote``, when the caller has
    looked it up). Returns how many files went (those already there are not sent again). A remote that cannot be
    reached is a one-line error naming it."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    remote = remote or default_remote(root)
    if remote is None:
        raise MergeflowError("no DVC remote to push to: set one with `mergeflow remote add URL`")
    failures: list[BaseException | str] = []
    # s3fs leaves a coroutine unawaited when a connection fails: a warning at exit that says nothing to a user
    warnings.filterwarnings("ignore", message="coroutine '.*' was never awaited", category=RuntimeWarning)
    try:
        with Repo(str(root)) as repo, _dvc_errors_kept(failures):
            return repo.push(jobs=jobs)
    except Exception as err:  # noqa: BLE001 - DVC's, the file system's or a cloud client's: one line either way
        kind = "" if isinstance(err, DvcException) else f"{type(err).__name__}: "
        said = first_line(err, "failed")
        first = f" (the first: {_transfer_error(failures[0])})" if failures and "failed to upload" in said else ""
        if isinstance(err, PermissionError) or "Forbidden" in first:
            first += "; check the remote's credentials (in the environment, or `dvc remote modify --local`)"
        if (
            failures and getattr(failures[0], "errno", None) == errno.ENOSPC and not urlsplit(remote.url).scheme
        ):  # a local folder
            store = Path(root) / ".dvc" / remote.url  # a relative URL is relative to .dvc/ (an absolute one stays)
            first += f"; {_sweep_partial_uploads(store)} partial files it left there removed"
        raise MergeflowError(f"dvc push to {remote}: {kind}{said[:200]}{first}") from None


@contextlib.contextmanager
def _dvc_errors_kept(kept: list[BaseException | str]):
    """DVC's per-file error lines (one per file that failed: hundreds when the remote is full) kept in ``kept`` (each
    its exception, else its message) instead of printed: the push's error names the count and the first."""
    import logging

    class Keep(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno >= logging.ERROR and record.getMessage().startswith("failed to transfer"):
                kept.append(record.exc_info[1] if record.exc_info and record.exc_info[1] else record.getMessage())
                return False
            return True

    # on the handlers: a logger's own filters see only the records logged to it, not its children's (dvc.*)
    handlers, keep = list(logging.getLogger("dvc").handlers), Keep()
    for handler in handlers:
        handler.addFilter(keep)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(keep)


def _transfer_error(failure: BaseException | str) -> str:
    """'[Errno 28] No space left on device', without the paths an OSError names after it."""
    if isinstance(failure, OSError) and failure.strerror:
        return f"[Errno {failure.errno}] {failure.strerror}"
    return first_line(failure)[:120]


# DVC's temporary name for a file it is writing into a local remote: .<22 URL-safe characters>.tmp
_PARTIAL_UPLOAD = re.compile(r"^\.[A-Za-z0-9_-]{22}\.tmp$")


def _sweep_partial_uploads(store: Path) -> int:
    """Remove what a push that ran out of space left in a local remote (DVC does not: each file it was writing
    stays under its temporary name, holding the space the next push needs); their count."""
    removed = 0
    for partial in store.glob("files/md5/*/.*.tmp"):
        if _PARTIAL_UPLOAD.match(partial.name):
            partial.unlink(missing_ok=True)
            removed += 1
    return removed
