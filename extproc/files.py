"""Reading a file that is watched for edits: a cheap stat stamp says when to read it again, and a
digest of the bytes says whether they changed.

The catalog file (:mod:`extproc.sources.file`) and the latency profiles
(:mod:`extproc.scheduling.profiles`) are both polled this way.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RACY_NS", "FileRead", "FileStamp", "FileTooLarge", "read_stamped"]

#: File systems stamp mtimes from a coarse clock: two same-size writes within one tick look alike.
#: A file modified this recently is read and compared again on the next poll rather than trusted
#: (like git's "racily clean" entries).
RACY_NS = 2_000_000_000


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What stat says cheaply; a different stamp means "read and compare", not "changed"."""

    mtime_ns: int
    size: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_mtime_ns, st.st_size, st.st_ino)

    @classmethod
    def at(cls, path: Path) -> FileStamp:
        """The stamp of ``path`` now; raises OSError like ``os.stat``."""
        return cls.of(os.stat(path))


class FileTooLarge(Exception):
    """The file is over the read's limit; ``size`` is its size as stamped."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size:,} bytes, over the {limit:,}-byte limit")
        self.size = size
        self.limit = limit


@dataclass(frozen=True, slots=True)
class FileRead:
    """The bytes of one read, with the stamp of the file they came from."""

    stamp: FileStamp
    digest: bytes
    data: bytes
    #: Modified so recently that an immediate second write could keep the same stamp: do not trust
    #: an equal stamp next time.
    racy: bool


def read_stamped(
    path: Path, *, limit: int | None = None, clock_ns: Callable[[], int] = time.time_ns
) -> FileRead:
    """Read ``path`` and stamp it from the same open file, so stamp and bytes belong together.

    With ``limit``, at most ``limit + 1`` bytes are read, and a file over it raises
    :class:`FileTooLarge` without being read whole or hashed. Raises OSError when it cannot be read.
    """
    with path.open("rb") as fh:
        stamp = FileStamp.of(os.fstat(fh.fileno()))
        data = fh.read() if limit is None else fh.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise FileTooLarge(stamp.size, limit)
    racy = clock_ns() - stamp.mtime_ns < RACY_NS
    return FileRead(stamp, hashlib.sha256(data).digest(), data, racy)
