"""Writing files whole or not at all, and owning an output while writing it.

Every file handgrad writes goes through here or through a temporary directory renamed into place,
so a failed write (a full disk, a vanished mount) leaves the old file or nothing, never a partial
one that looks valid; the failure surfaces as an OSError naming the path, which the commands turn
into one line. safetensors raises its own error type; `save_safetensors` turns it into an OSError.

`OutputLock` makes one process the owner of an output (a run directory, a data directory, a
converted model): an advisory lock (flock) on a file, which the kernel releases when the process
exits, however it exits, so a SIGKILL never leaves a stale lock.
"""
import errno
import fcntl
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.numpy import save_file


def write_atomic(path, text):
    """Replace a text file whole or not at all (a kill or a full disk mid-write leaves the old one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_safetensors(tensors, path, metadata=None):
    """safetensors.numpy.save_file, failing as an OSError naming the path (safetensors raises its
    own SafetensorError, for a full disk among others)."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        cause = str(e)
        code = errno.ENOSPC if "No space left" in cause else errno.EIO
        raise OSError(code, cause.removeprefix("Error while serializing: "), str(path)) from None


class OutputLockedError(ValueError):
    """Another process owns the output; the message names it and its pid."""


class OutputLock:
    """An exclusive advisory lock on `lock_path`, held until release() or the process exits.

    acquire() raises OutputLockedError naming the other process's pid (written into the lock file
    by whoever holds it) instead of waiting. `what` names the output in that message.
    """

    def __init__(self, lock_path, what):
        self.path, self.what, self.fd = Path(lock_path), what, None

    def acquire(self):
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputLockedError(f"{self.what}: in use by another handgrad process (pid {pid}); wait for "
                                        f"it to finish or stop it, or choose another output") from None
            # a holder that removed the file as we opened it leaves us locking an unlinked inode: retry
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # a full disk has no room for the pid: no lock file left behind, the error goes on
            self.path.unlink(missing_ok=True)
            os.close(fd)
            raise
        self.fd = fd
        return self

    def release(self, remove=False):
        """Let go of the lock; with remove, delete the lock file first (while still holding it)."""
        if self.fd is None:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None

    def __del__(self):  # an owner dropped without release() (a failed constructor, a test) lets go
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):  # a lock acquired already (to report its failure apart) is entered as it is
        return self if self.fd is not None else self.acquire()

    def __exit__(self, *exc):
        self.release(remove=True)


def lock_output(out):
    """Own the output `out` (a directory or file made whole through a temporary sibling) while
    writing it: a lock file beside it, `.{name}.lock`, removed on release. Use as a context manager."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return OutputLock(out.parent / f".{out.name}.lock", str(out))
