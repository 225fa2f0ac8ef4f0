"""The disk tier: one file per entry, written atomically, verified on every read.

Files live under ``<disk_path>/<model fingerprint>/``, so entries of the same
model survive an engine restart (their keys are stable) and other models'
entries never mix in. A file is written to a temporary name, flushed to disk
and renamed, so a crash leaves either no entry or a whole one; a checksum in
its header catches anything else, and such a file is deleted, not served.

A header is checked field by field, types included: a file that is not a whole entry of this
format (cut off, damaged, written by something else) is deleted and counted (``damaged``),
never served and never a reason to stop; the engine starts whatever the folder holds.

The checksum is CRC32: it catches accidents (a torn write, a flipped bit), not tampering.
Whoever can write the folder can make the engine serve KV of their choosing, just as whoever
can write the checkpoint can change the model, so the folder is as trusted as the weights
(README: only the server's user may write it). The engine creates it private (0700) and
warns at start when it finds it writable by others. A keyed digest would not change that:
its key would have to live where the same users cannot read it, and be kept across restarts.

Each header names the entry's parent, so the chains survive a restart too. The tier
keeps only what a lookup can reach: it evicts chain ends first (``chains``), and it
refuses an entry whose parent it does not hold, or could only make room for by
evicting that parent: such an entry would be unreachable the moment it landed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from siesta.kv.hashing import BlockHash
from siesta.tiers.base import DropReason
from siesta.tiers.chains import ChainIndex

logger = logging.getLogger(__name__)

MAGIC = b"SKV1"
_HEADER_LEN = struct.Struct("<I")
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
PRIVATE_MODE = 0o700  # only the server's user writes the tier (see the module's docstring)


@dataclass
class DiskEntry:
    path: Path
    version: str
    nbytes: int  # file size, header included
    parent: BlockHash | None = None  # the entry before it in its chain; None: the chain's first


@dataclass(frozen=True)
class Header:
    """A file's header, every field of the type it must have."""

    key: BlockHash
    version: str
    parent: BlockHash | None
    data_bytes: int
    crc32: int
    offset: int  # where the payload starts

    @property
    def file_bytes(self) -> int:
        return self.offset + self.data_bytes


@dataclass(frozen=True)
class DiskWrite:
    """What a write did: ``nbytes`` written (0: nothing), ``dropped`` why not when it had to be."""

    nbytes: int
    dropped: DropReason | None = None


class DiskTier:
    def __init__(self, root: str | os.PathLike, model_fingerprint: str, capacity_bytes: int, entry_bytes: int) -> None:
        self.dir = Path(root) / model_fingerprint
        self.dir.mkdir(mode=PRIVATE_MODE, parents=True, exist_ok=True)
        _warn_if_others_may_write(self.dir)
        self.capacity = capacity_bytes
        self.entry_bytes = entry_bytes
        self._lock = threading.Lock()
        self._index: ChainIndex[DiskEntry] = ChainIndex()
        self.bytes_used = 0
        self.evictions = 0
        self.damaged = 0  # files found not whole or not ours, deleted
        self._scan()

    # -- index -------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the files a previous engine left, oldest first."""
        for tmp in self.dir.glob(f"*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)  # a write that never finished
        files = sorted(_stat_all(self.dir.glob(f"*{SUFFIX}")), key=lambda ps: ps[1].st_mtime)
        for path, st in files:
            header = _read_header(path)
            if header is None or st.st_size != header.file_bytes:
                self._discard(path)
                continue
            if header.key in self._index:  # a second file of one key (copied by hand): kept once
                path.unlink(missing_ok=True)
                continue
            self._add(header.key, DiskEntry(path, header.version, header.file_bytes, header.parent))
        if self.damaged:
            logger.warning("disk tier: deleted %d files of %s that were not whole entries", self.damaged, self.dir)
        self._evict_to_fit(0, parent=None)

    def _discard(self, path: Path) -> None:
        self.damaged += 1
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)

    def _add(self, key: BlockHash, entry: DiskEntry) -> None:
        self._index.add(key, entry)
        self.bytes_used += entry.nbytes

    def _remove(self, key: BlockHash) -> None:
        entry = self._index.pop(key)
        if entry is not None:
            self._delete(entry)

    def _delete(self, entry: DiskEntry) -> None:
        self.bytes_used -= entry.nbytes
        entry.path.unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, key: BlockHash) -> bool:
        with self._lock:
            return key in self._index

    # -- data --------------------------------------------------------------------------

    def write(self, key: BlockHash, version: str, data: memoryview, parent: BlockHash | None = None) -> DiskWrite:
        """Store an entry that follows ``parent`` in its chain; safe from a background thread.
        Nothing is written when the key is already here, or (``dropped`` says why) when its
        parent is not, no room can be made or the file cannot be written."""
        header = self._header(key, version, parent, data)
        total = len(header) + len(data)
        if total > self.capacity:
            return DiskWrite(0, DropReason.NO_SPACE)
        final = self.dir / f"{key.hex()}{SUFFIX}"
        tmp = final.with_name(final.name + f".{threading.get_ident()}{TMP_SUFFIX}")
        with self._lock:
            if key in self._index:
                return DiskWrite(0)
            if parent is not None and parent not in self._index:
                return DiskWrite(0, DropReason.PARENT_MISSING)
            if not self._evict_to_fit(total, parent):
                return DiskWrite(0, DropReason.NO_SPACE)
            # Count the bytes before they land, so concurrent writers never overshoot the budget.
            self.bytes_used += total
        try:
            _write_file(tmp, final, header, data)
        except OSError:
            logger.exception("disk tier: writing %s failed", final)
            with contextlib.suppress(OSError):  # the directory itself may be what broke
                tmp.unlink(missing_ok=True)
            with self._lock:
                self.bytes_used -= total
            return DiskWrite(0, DropReason.IO_ERROR)
        with self._lock:
            self.bytes_used -= total
            if key in self._index:  # another writer's file of the same key, the same bytes
                return DiskWrite(0)
            if parent is not None and parent not in self._index:  # gone meanwhile: evicted, or found damaged
                final.unlink(missing_ok=True)
                return DiskWrite(0, DropReason.PARENT_MISSING)
            self._add(key, DiskEntry(final, version, total, parent))
        return DiskWrite(total)

    def read(self, key: BlockHash) -> bytes | None:
        """The entry's data if it is whole and unchanged; a damaged entry is deleted and missed."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._index.touch(key)
        try:
            raw = entry.path.read_bytes()
        except OSError:
            raw = b""
        data = _verified_payload(raw, key)
        if data is None:
            logger.warning("disk tier: %s is damaged; deleted", entry.path)
            with self._lock:
                self.damaged += 1
                self._remove(key)
        return data

    def evict_where(self, predicate) -> int:
        with self._lock:
            doomed = [k for k, e in self._index.items() if predicate(k, e)]
            for key in doomed:
                self._remove(key)
            self.evictions += len(doomed)
        return len(doomed)

    def _evict_to_fit(self, incoming: int, parent: BlockHash | None) -> bool:
        """Evict chain ends, least recently used first, until ``incoming`` bytes fit; never
        ``parent``, the entry the incoming one follows. False if that leaves too little room."""
        while self.bytes_used + incoming > self.capacity:
            victim = self._index.evict_end(lambda key, entry: key != parent)
            if victim is None:
                return False
            self._delete(victim[1])
            self.evictions += 1
        return True

    def _header(self, key: BlockHash, version: str, parent: BlockHash | None, data: memoryview) -> bytes:
        meta = {"key": key.hex(), "version": version, "parent": None if parent is None else parent.hex(),
                "data_bytes": len(data), "crc32": zlib.crc32(data)}  # fmt: skip
        body = json.dumps(meta, sort_keys=True).encode()
        return MAGIC + _HEADER_LEN.pack(len(body)) + body


def _write_file(tmp: Path, final: Path, header: bytes, data: memoryview) -> None:
    """Written whole under a temporary name, on the disk, then renamed: all or nothing."""
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _stat_all(paths) -> list[tuple[Path, os.stat_result]]:
    """Each path with its stat; one gone meanwhile (another engine evicted it) is skipped."""
    out = []
    for path in paths:
        with contextlib.suppress(OSError):
            out.append((path, path.stat()))
    return out


def _warn_if_others_may_write(directory: Path) -> None:
    for folder in (directory, directory.parent):
        with contextlib.suppress(OSError):
            mode = folder.stat().st_mode
            # A sticky folder (/tmp) lets others add files beside ours, not replace our folder.
            if mode & (stat.S_IWGRP | stat.S_IWOTH) and not (folder != directory and mode & stat.S_ISVTX):
                logger.warning(
                    "disk tier: %s is writable by other users; whoever writes it decides what KV is served "
                    "(CRC32 catches accidents, not tampering): chmod go-w it", folder,
                )  # fmt: skip


def _hex_key(value: object) -> BlockHash | None:
    if not isinstance(value, str) or len(value) > _MAX_KEY_HEX:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def _is_int(value: object, below: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < below


def _parse(raw: bytes) -> Header | None:
    """The header, or None when the bytes are not a siesta entry (any field missing or of the
    wrong type counts: a file is served only when every field is what a write puts there)."""
    prefix = len(MAGIC) + _HEADER_LEN.size
    if len(raw) < prefix or raw[: len(MAGIC)] != MAGIC:
        return None
    (n,) = _HEADER_LEN.unpack(raw[len(MAGIC) : prefix])
    if n > _MAX_HEADER_BYTES - prefix or len(raw) < prefix + n:
        return None
    try:
        meta = json.loads(raw[prefix : prefix + n])
    except (ValueError, RecursionError):
        return None
    if not isinstance(meta, dict):
        return None
    key, parent = _hex_key(meta.get("key")), meta.get("parent")  # absent parent: an older file's chain start
    parent_key = None if parent is None else _hex_key(parent)
    version, data_bytes, crc = meta.get("version"), meta.get("data_bytes"), meta.get("crc32")
    if key is None or (parent is not None and parent_key is None) or not isinstance(version, str):
        return None
    if not _is_int(data_bytes, _MAX_ENTRY_BYTES) or not _is_int(crc, 1 << 32):
        return None
    return Header(key, version, parent_key, data_bytes, crc, prefix + n)


_MAX_HEADER_BYTES = 4096
_MAX_KEY_HEX = 256
_MAX_ENTRY_BYTES = 1 << 48


def _read_header(path: Path) -> Header | None:
    try:
        with open(path, "rb") as f:
            head = f.read(_MAX_HEADER_BYTES)
    except OSError:
        return None
    return _parse(head)


def _verified_payload(raw: bytes, key: BlockHash) -> bytes | None:
    header = _parse(raw[:_MAX_HEADER_BYTES])
    if header is None:
        return None
    data = raw[header.offset :]
    if header.key != key or len(data) != header.data_bytes:
        return None
    if zlib.crc32(data) != header.crc32:
        return None
    return data
