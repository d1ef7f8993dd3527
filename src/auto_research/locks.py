"""One writer per folder: an exclusive lock held for the whole life of a run.

A run takes ``fcntl.flock`` on ``<folder>/.lock`` before it reads, deletes or writes anything there, and writes its
host, PID and start time inside. The kernel drops the lock when the process dies, so a SIGKILL leaves no stale lock.
A second process that finds the lock held stops with one line naming the holder.

A lock is taken on the open file, not the name: at release the file is removed, so after locking a process checks
that the name still points at the file it locked (else it tries again). The same check, before every write, tells
a live run that its folder was deleted or replaced under it. Where the filesystem cannot lock (``ENOLCK``,
``EOPNOTSUPP``: some network filesystems) a warning is printed once and the run goes on unprotected.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from auto_research.errors import UserError

LOCK_NAME = ".lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_warned = False


def _warn_once(folder: Path, error: OSError) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"auto-research: warning: {folder}'s filesystem cannot lock ({error.strerror or error}); nothing stops "
              "a second run from writing the same folder", file=sys.stderr)


def describe_holder(path: Path) -> str:
    """'host H, PID P, since T' from a lock file, or what can be said without it."""
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        holder = {}
    if not holder:
        return "another process (it has not written its name yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, since {since}"


def _in_use(folder, what: str, path: Path) -> UserError:
    return UserError(f"{folder} is in use by another {what} ({describe_holder(path)}): one process writes a folder at "
                     "a time; wait for it to finish, or stop it first")


class FolderLock:
    """The exclusive lock on one folder, held from ``acquire`` to ``release``. ``created``: the outermost folder
    acquiring created (None when the folder existed), removed again by a run that fails before it wrote anything
    worth keeping, so a bad input leaves no trace."""

    def __init__(self, folder: str | os.PathLike, what: str = "run"):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.what = what
        self.fd: int | None = None
        self.created: Path | None = None
        self.supported = True

    def acquire(self) -> "FolderLock":
        if self.folder.exists() and not self.folder.is_dir():
            raise UserError(f"{self.folder} is a file, not a folder: the {self.what} cannot write there")
        if self.folder.is_dir() and not os.access(self.folder, os.W_OK | os.X_OK):
            raise UserError(f"cannot write to {self.folder}: no permission (the {self.what} folder must be writable)")
        for folder in (self.folder, *self.folder.parents):
            if folder.exists():
                break
            self.created = folder
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UserError(f"cannot create {self.folder}: {error.strerror or error}") from None
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                self.remove_created()
                raise UserError(f"cannot write to {self.folder}: {error.strerror or error}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _in_use(self.folder, self.what, self.path) from None
            except OSError as error:
                if error.errno not in _UNSUPPORTED:
                    os.close(fd)
                    raise
                _warn_once(self.folder, error)
                self.supported = False
            if self._same_file(fd):
                self.fd = fd
                os.ftruncate(fd, 0)
                os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                         "started": time.time()}).encode())
                return self
            os.close(fd)  # released and removed by its holder just before we locked it: try again
        raise UserError(f"cannot lock {self.path}: it keeps being replaced")  # pragma: no cover

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def check(self) -> None:
        """Before a write: the folder is still the one this run locked (not deleted, not replaced)."""
        if self.fd is not None and not self._same_file(self.fd):
            raise UserError(f"{self.folder} was deleted or replaced while the {self.what} was running; stopped "
                            "without writing anything more")

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if self._same_file(self.fd):
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def remove_created(self) -> None:
        """Remove the folders that acquiring created (a run that wrote nothing worth keeping): the locked
        folder with what this run wrote in it, then each parent it created while that parent is empty
        (another run may have written there since)."""
        if self.created is None:
            return
        shutil.rmtree(self.folder, ignore_errors=True)
        for folder in self.folder.parents:
            if folder == self.created.parent:
                break
            try:
                folder.rmdir()
            except OSError:
                break
        self.created = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_unlocked(folder: str | os.PathLike, what: str = "run") -> None:
    """Refuse, in one line, a folder that a live process holds (a planned run of compare, say)."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file: nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(folder, what, path) from None
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(folder: str | os.PathLike, what: str = "run", keep=lambda: False):
    """``with locked(folder):`` the folder is this process's alone; if the body fails and ``keep()`` is
    false, the folders that locking created are removed again."""
    lock = FolderLock(folder, what).acquire()
    try:
        yield lock
    except BaseException:
        if not keep():
            lock.remove_created()
        raise
    finally:
        lock.release()


def entries(folder: str | os.PathLike) -> list[Path]:
    """What a folder holds, its lock file aside."""
    folder = Path(folder)
    return [path for path in folder.iterdir() if path.name != LOCK_NAME] if folder.is_dir() else []
