"""The uids of a sandbox's slots, claimed so that no other sandbox on the machine runs code as the same uid.

Slot k of a sandbox runs its checker as CHECKER_UID + o and the candidate as CANDIDATE_UID + o, where o is an
offset in [0, UID_SPAN) that this process holds an exclusive lock on (``LOCK_DIR/uid-O.lock``, flock). Two trainers,
a trainer and ``rlvr serve``, or parallel test workers on one machine thus never share a uid: a uid's process
limit (RLIMIT_NPROC counts every process of the uid) and its signals stay within one execution. A process that
dies releases its locks with it. Only a root sandbox switches uids; in the other modes every slot runs as the
trainer's own user and nothing is claimed.
"""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from pathlib import Path

CHECKER_UID, CANDIDATE_UID = 61000, 62000
UID_SPAN = 1000  # offsets 0..999: checkers 61000-61999, candidates 62000-62999


def lock_dir() -> Path:
    """/run/lock/rlvr-sandbox where /run/lock exists, else under the temp directory; made 0700 by this user, and
    refused if it is a link or another user's (its lock files decide who runs as which uid)."""
    base = Path("/run/lock") if os.path.isdir("/run/lock") else Path(tempfile.gettempdir())
    path = base / "rlvr-sandbox-uids"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{path} is not a private directory of this user: remove it (it only holds sandbox "
                           "uid locks)")
    return path


class SlotUids:
    """Offsets for ``slots`` slots, claimed when ``claim`` (else 0, 1, ...); ``checker(k)`` and ``candidate(k)`` are
    slot k's uids."""

    def __init__(self, slots: int, claim: bool = True) -> None:
        self._fds: list[int] = []
        self.offsets: list[int] = [] if claim else list(range(slots))
        if not claim:
            return
        directory = lock_dir()
        for offset in range(UID_SPAN):
            if len(self.offsets) == slots:
                break
            fd = os.open(directory / f"uid-{offset}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._fds.append(fd)
            self.offsets.append(offset)
        if len(self.offsets) < slots:
            self.close()
            raise RuntimeError(f"every sandbox uid offset (0-{UID_SPAN - 1}) is held by other sandboxes on this "
                               f"machine; {slots} slots need {slots}: stop some of them or use fewer slots")

    def checker(self, slot: int) -> int:
        return CHECKER_UID + self.offsets[slot]

    def candidate(self, slot: int) -> int:
        return CANDIDATE_UID + self.offsets[slot]

    def close(self) -> None:
        """Release the claims (the offsets stay readable: a closed sandbox runs nothing)."""
        for fd in self._fds:
            os.close(fd)  # releases the lock
        self._fds = []
