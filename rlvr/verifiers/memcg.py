"""A memory cgroup per sandbox slot: caps the resident memory of a whole execution - every process in it and
the tmpfs pages of its /work and /tmp - where the trainer may create cgroups.

Where: under the trainer's own cgroup, in the cgroup v2 hierarchy when memory can be delegated to its
children (``memory`` in its ``cgroup.subtree_control``, or enabled there: possible only where it holds no
process, e.g. the root cgroup), else in a cgroup v1 ``memory`` hierarchy (no such rule), or under a
directory the caller names (a delegated, empty v2 cgroup). Where none is writable - an unprivileged user
without delegation, a read-only /sys/fs/cgroup - there is no memory cgroup and only the per-process
address-space limit (``prlimit --as``) holds, ``reason`` says why. Swap is not allowed (v2
``memory.swap.max``, v1 ``memsw``) where the kernel accounts it. Past the limit the kernel's OOM killer
kills the largest process of the slot; the tests it had not finished fail.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

_names = itertools.count()


def find_parent(proc_cgroup: str, mountinfo: str) -> tuple[str, str] | None:
    """(version, directory) of the caller's own cgroup: v2 when the v2 hierarchy has the memory controller
    there, else v1's memory hierarchy; None when neither is mounted. From /proc/self/{cgroup,mountinfo}."""
    mounts = []  # (fstype, mount root, mount point, super options)
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            mounts.append((tail[0], fields[3], fields[4], tail[2].split(",")))
    own = {}  # controller ("" for v2) -> path
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    for fstype, root, point, options in mounts:
        if fstype == "cgroup2" and "" in own:
            directory = _inside(point, root, own[""])
            if directory and "memory" in _read(Path(directory) / "cgroup.controllers").split():
                return "v2", directory
    for fstype, root, point, options in mounts:
        if fstype == "cgroup" and "memory" in options and "memory" in own:
            directory = _inside(point, root, own["memory"])
            if directory:
                return "v1", directory
    return None


def _inside(point: str, root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` under a mount of hierarchy subtree ``root`` at ``point``."""
    if root != "/" and path != root and not path.startswith(root + "/"):
        return None
    relative = path[len(root):] if root != "/" else path
    return point.rstrip("/") + relative.rstrip("/") if relative.strip("/") else point


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class SlotCgroups:
    """``paths[k]``: the cgroup directory of slot k, or ``paths`` None (``reason`` says why)."""

    def __init__(self, slots: int, limit_mb: int, parent: str | None = None) -> None:
        self.paths: list[str] | None = None
        self.version, self.reason = "", "no memory cgroup (turned off); only the address-space limit holds"
        if slots <= 0:
            return
        try:
            found = _given(parent) if parent else find_parent(_read(Path("/proc/self/cgroup")),
                                                               _read(Path("/proc/self/mountinfo")))
            if found is None:
                raise OSError("no cgroup v2 hierarchy with the memory controller and no v1 memory hierarchy")
            self.version, directory = found
            remove_stale(Path(directory))
            if self.version == "v2" and "memory" not in _read(Path(directory) / "cgroup.subtree_control").split():
                (Path(directory) / "cgroup.subtree_control").write_text("+memory")
            made = []
            try:
                for k in range(slots):
                    made.append(self._make(Path(directory), k, limit_mb << 20))
            except OSError:
                _remove(made)
                raise
            self.paths = [str(p) for p in made]
        except OSError as err:
            self.version, self.reason = "", f"no memory cgroup ({err}); only the address-space limit holds"

    def _make(self, parent: Path, slot: int, limit: int) -> Path:
        path = parent / f"rlvr-sandbox-{os.getpid()}-{next(_names)}-slot{slot}"
        path.mkdir()
        try:
            if self.version == "v2":
                (path / "memory.max").write_text(str(limit))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit))
                if (path / "memory.memsw.limit_in_bytes").exists():
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        except OSError:
            path.rmdir()
            raise
        return path

    def close(self) -> None:
        if self.paths:
            _remove([Path(p) for p in self.paths])
        self.paths = None


def _given(parent: str) -> tuple[str, str]:
    directory = Path(parent)
    if (directory / "cgroup.controllers").exists():
        return "v2", str(directory)
    if (directory / "memory.limit_in_bytes").exists():
        return "v1", str(directory)
    raise OSError(f"{parent} is neither a cgroup v2 directory nor a cgroup v1 memory directory")


def _remove(paths: list[Path], tries: int = 20) -> None:
    for path in paths:
        for _ in range(tries):
            try:
                path.rmdir()  # empty once the slot's last execution has ended ...
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)  # ... though the kernel may release its last task a moment later


def remove_stale(parent: Path) -> None:
    """Slot cgroups left by a trainer that was killed (its pid is gone)."""
    for path in parent.glob("rlvr-sandbox-*-slot*"):
        pid = path.name.split("-")[2]
        if pid.isdecimal() and not os.path.exists(f"/proc/{pid}"):
            _remove([path], tries=1)
