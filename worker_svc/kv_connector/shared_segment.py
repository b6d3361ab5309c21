"""Same-host KV delivery: a POSIX shared-memory segment offered with a pull (kv.v1
PullKvRequest's shared_memory_name), owned by the consumer, written by the producer.

The consumer makes its segments (mode 0600, a random 128-bit name, pages reserved up front) and
reuses each for its next pulls (SegmentPool: a fresh segment's first writes fault every page in
again, ~4x the copy); a pull that did not end cleanly retires its segment, since its producer may
still be writing. A producer whose host identity (boot id and IPC namespace) is the same opens the
named segment, checks its size, and writes each chunk's bytes at the chunk's place instead of
sending them: the stream carries only the chunks' headers. A producer that cannot open it (another
host, IPC namespace or user, a name or size that does not fit) sends the bytes in the stream, so
the path needs no configuration to be safe.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
from functools import cache
from multiprocessing.shared_memory import SharedMemory

NAME = re.compile(r"splitserve-kv-[0-9a-f]{32}")
"""The names a producer opens (a consumer's, never any other segment of the host)."""
SHM_FOLDER = "/dev/shm"
SIZE_STEP = 16 << 20
"""A consumer's segments are sized in these steps, so one serves many loads' sizes."""
MAX_IDLE = 2
"""Idle segments a consumer keeps (one per pull thread)."""


@cache
def host_identity() -> str:
    """This process's host and IPC namespace: equal on both ends only when a segment one
    creates is a segment the other can open."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        return ""  # no way to tell: never shared
    return f"{boot}/{namespace}"


def segment_offset(layer: int, first_block: int, num_blocks: int, block_bytes: int) -> int:
    """Where a chunk's bytes start in a segment of `num_blocks` blocks per layer."""
    return (layer * num_blocks + first_block) * block_bytes


def create_segment(size: int) -> SharedMemory | None:
    """A new segment of `size` bytes under a random NAME (the consumer's; it unlinks it), its
    pages reserved now: None when /dev/shm cannot hold it (a container's 64 MiB default), where
    writing into a sparse segment would kill the writer with SIGBUS."""
    try:
        segment = SharedMemory(f"splitserve-kv-{secrets.token_hex(16)}", create=True, size=size)
    except OSError:
        return None
    try:
        os.posix_fallocate(segment._fd, 0, size)  # type: ignore[attr-defined]
    except OSError:
        segment.close()
        segment.unlink()
        return None
    return segment


class MappedSegment:
    """A producer's mapping of a consumer's segment, its pages mapped in one go."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._mapping = mapping
        self.buf = memoryview(mapping)

    def close(self) -> None:
        self.buf.release()
        self._mapping.close()


def open_segment(name: str, size: int) -> MappedSegment | None:
    """The consumer's segment `name` when it is one (NAME) of at least `size` bytes, else None
    (the producer then sends the bytes in the stream)."""
    if not NAME.fullmatch(name) or size <= 0:
        return None
    try:
        fd = os.open(os.path.join(SHM_FOLDER, name), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < size:
            return None
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return MappedSegment(mmap.mmap(fd, size, flags=flags))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class SegmentPool:
    """A consumer's segments: `take` one of at least a size (reused, or new in SIZE_STEPs),
    `give_back` it after the pull (kept when the pull ended cleanly, else removed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[SharedMemory] = []

    def take(self, size: int) -> SharedMemory | None:
        with self._lock:
            fits = [s for s in self._idle if s.size >= size]
            if fits:
                segment = min(fits, key=lambda s: s.size)
                self._idle.remove(segment)
                return segment
        return create_segment(-(-size // SIZE_STEP) * SIZE_STEP)

    def give_back(self, segment: SharedMemory, is_clean: bool) -> None:
        with self._lock:
            if is_clean:
                self._idle.append(segment)
                if len(self._idle) <= MAX_IDLE:
                    return
                segment = min(self._idle, key=lambda s: s.size)
                self._idle.remove(segment)
        _remove(segment)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for segment in idle:
            _remove(segment)


def _remove(segment: SharedMemory) -> None:
    segment.close()
    segment.unlink()
