"""The one errno table: domain errors and how they reach FUSE and the CLI."""

from __future__ import annotations

import errno


class FsError(Exception):
    """An operation failed with a POSIX errno (raised by the core, mapped by fs.py)."""

    def __init__(self, err: int, why: str = ""):
        super().__init__(why or errno.errorcode.get(err, str(err)))
        self.errno = err


class CliError(Exception):
    """A user-facing error: the CLI prints `ckptfs: error: <message>` and exits 1."""


class CorruptData(FsError):
    """A record failed its checksum on read: the extent is damaged, the request gets EIO."""

    def __init__(self, where: str):
        super().__init__(errno.EIO, f"checksum mismatch: {where}")
        self.where = where


def to_errno(exc: BaseException) -> int:
    """The errno a FUSE request answers with for an exception raised by the core."""
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return errno.EIO
