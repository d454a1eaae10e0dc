"""Processes of a test's own: what runs below a pid (from /proc), which are alive, what they are called, their
environment. Tests kill only what they started (never by name, never `ray stop`)."""

import os
import signal
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def names(pids: set[int]) -> set[str]:
    result = set()
    for pid in pids:
        try:
            result.add(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
    return result


def alive(pids: set[int]) -> set[int]:
    result = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            result.add(pid)
    return result


def environ(pid: int) -> dict[str, str]:
    """A process's environment as it started ({} when it is gone or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def kill(pids: set[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """Every TCP socket that these processes listen on: (address, port, pid); an IPv4-mapped IPv6 address as IPv4,
    every interface as '0.0.0.0' or '::'."""
    import ipaddress

    owners = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in owners:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            ip = ipaddress.ip_address(raw)
            ip = getattr(ip, "ipv4_mapped", None) or ip
            found.append((str(ip), int(port, 16), owners[fields[9]]))
    return found
