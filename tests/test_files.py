"""Watched-file reads: the stamp says when to read again, the digest whether the bytes changed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from extproc.files import RACY_NS, FileStamp, FileTooLarge, read_stamped


def test_a_read_carries_the_bytes_their_digest_and_the_files_stamp(tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_bytes(b"kind: List\n")
    read = read_stamped(path)
    assert read.data == b"kind: List\n"
    assert read.digest == hashlib.sha256(b"kind: List\n").digest()
    assert read.stamp == FileStamp.at(path)


def test_a_file_over_the_limit_is_refused_with_its_size(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * 100)
    with pytest.raises(FileTooLarge, match="100 bytes, over the 10-byte limit") as refused:
        read_stamped(path, limit=10)
    assert (refused.value.size, refused.value.limit) == (100, 10)
    assert read_stamped(path, limit=100).data == b"x" * 100


def test_a_file_modified_within_the_clocks_tick_is_not_trusted(tmp_path: Path) -> None:
    path = tmp_path / "profiles.yaml"
    path.write_bytes(b"a")
    mtime = path.stat().st_mtime_ns
    assert read_stamped(path, clock_ns=lambda: mtime + RACY_NS // 2).racy
    assert not read_stamped(path, clock_ns=lambda: mtime + RACY_NS).racy


def test_a_rewrite_of_other_size_or_a_replaced_file_changes_the_stamp(tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_bytes(b"one")
    before = FileStamp.at(path)
    path.write_bytes(b"three")
    assert FileStamp.at(path) != before
    rewritten = FileStamp.at(path)
    replacement = tmp_path / "new"
    replacement.write_bytes(b"three")
    inode = replacement.stat().st_ino
    os.replace(replacement, path)  # how editors and ConfigMap updates swap a file in
    assert FileStamp.at(path).inode == inode != rewritten.inode


def test_a_missing_file_raises_oserror_for_the_caller_to_report(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        FileStamp.at(tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        read_stamped(tmp_path / "absent")
