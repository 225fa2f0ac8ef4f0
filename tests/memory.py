"""What the kernel says a process holds: resident bytes of one mapping."""

from __future__ import annotations

from pathlib import Path


def resident_bytes(address: int) -> int:
    """The resident bytes of this process's mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1]) << 10
    raise LookupError(f"no mapping holds {address:#x}")
