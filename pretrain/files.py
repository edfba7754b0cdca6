"""
File helpers shared by everything that writes: atomic writes (temp file, fsync, rename), the
cleanup of temp files a killed writer left, and an exclusive lock on a directory (one writer per
run or data directory). Shards, manifests, checkpoints, metrics and configs are all written
through here.
"""

import errno
import fcntl
import glob
import os
import shutil


def fsync_dir(path):
    """Make a rename inside directory `path` durable."""
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomically(path, write):
    """Call write(f) on a temp file beside path (`<path>.tmp<pid>`), fsync it and rename it over path:
    a crash or a full disk leaves either the old file or the whole new one, never a partial file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_temp_files(directory, patterns):
    """Remove what a writer killed mid-write left in `directory`: the files and directories matching
    any of the glob `patterns` (e.g. "*.bin.tmp*"). Call it only while holding the directory's lock."""
    for path in sorted({p for pattern in patterns for p in glob.glob(os.path.join(glob.escape(directory), pattern))}):
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)


class DirectoryLocked(RuntimeError):
    """Another live process holds the lock of a directory."""


class DirectoryLock:
    """An exclusive lock on a directory, held through `<directory>/<name>` (which records the holder's
    PID). A POSIX lock: released by the kernel when the holder dies, however it dies (kill -9
    included), and not inherited by forked workers. Released and the lock file removed by release()."""

    def __init__(self, directory, name):
        self.path = os.path.join(directory, name)
        self.file = None

    def acquire(self):
        """Take the lock or raise DirectoryLocked naming the holder's PID."""
        while True:
            f = open(self.path, "a+")
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    f.close()
                    raise
                f.seek(0)
                holder = f.read().strip() or "unknown"
                f.close()
                raise DirectoryLocked(f"{os.path.dirname(self.path)} is in use by another process (PID {holder}, "
                                      f"lock file {self.path}); wait for it to finish or stop it") from None
            # the holder before us may have removed the file between our open and our lock: then the lock
            # we hold is on a deleted file that nobody else sees, and we try again with the new file
            try:
                same = os.path.samestat(os.fstat(f.fileno()), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            f.close()
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.file = f
        return self

    def release(self):
        if self.file is None:
            return
        try:
            os.remove(self.path)  # while still locked: no one else can be holding it
        except FileNotFoundError:
            pass
        self.file.close()  # closing releases the lock
        self.file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
