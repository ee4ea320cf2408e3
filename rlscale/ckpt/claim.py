"""One run per checkpoint directory.

A run's start removes the half-written saves a crash left (tmp_step_N): a second run started on
the same directory while the first is still saving would delete the first one's save in flight,
and the two would then overwrite each other's steps and metrics. So a run claims the directory
with an exclusive `flock` on <checkpoint_dir>/.rlscale.lock for as long as it runs, and a second
run is refused with one line. The lock file is removed when the claim ends, so a finished or
failed run leaves nothing behind; after a crash the OS drops the lock and the next run takes over.

A holder on another node may be a node that died: on a shared file system (NFS, Lustre with
`-o flock`) its lock outlives it until the server's lease for that client ends (tens of seconds
to minutes), and the job's retry would be refused meanwhile. So a claim held from another node is
waited for, up to `wait_s` (checkpointing.claim_wait_s), before the refusal; a holder on this node
is a live run (the OS drops a dead process's lock at once) and is refused at once. "This node" is
the kernel's boot id, which every container of a machine shares: a pod's hostname is its own and
may even come back unchanged on another machine (StatefulSets, indexed Jobs).

A file system without flock (a Lustre client mounted without `-o flock`) gets no claim rather
than a refusal. Claims are per process: a process that claims a directory it already holds
shares that claim (counted), as two Checkpointers of one process may.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path
from typing import Callable

from rlscale.errors import UserError

LOCK_NAME = ".rlscale.lock"
_HELD: dict[str, list] = {}  # resolved lock path -> [open file, holders]


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _holder_note() -> str:
    boot = _boot_id()
    return f"pid {os.getpid()} on {os.uname().nodename}" + (f", boot {boot}" if boot else "")


def _held_elsewhere(holder: str) -> bool:
    """Whether the lock file's note names another machine: by boot id, or by hostname for a note
    without one (an empty or unreadable note counts as elsewhere)."""
    boot = _boot_id()
    noted = holder.rpartition(", boot ")[2] if ", boot " in holder else None
    if boot and noted:
        return noted != boot
    return holder.partition(" on ")[2].partition(", boot ")[0] != os.uname().nodename


def claim(root: Path, wait_s: float = 0.0, poll_s: float = 2.0,
          notify: Callable[[str], None] | None = None) -> str | None:
    """Claim `root` for this process; returns a token for `release` (None: no locking here).
    wait_s: how long to wait for a holder on another node to go (see the module's note);
    notify(line) is told once when the wait starts."""
    path = str((Path(root) / LOCK_NAME).resolve())
    deadline = time.monotonic() + wait_s
    waited = False
    if path in _HELD:
        try:  # still the file this process locked? (the directory may have been removed and made again)
            current = os.fstat(_HELD[path][0].fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            current = False
        if current:
            _HELD[path][1] += 1
            return path
        _HELD.pop(path)[0].close()  # a stale claim: take the directory afresh
    while True:
        handle = open(path, "a+", errors="replace")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                return None  # ENOLCK, EOPNOTSUPP, ENOSYS: no locking on this file system
            if _held_elsewhere(holder) and time.monotonic() < deadline:
                # an empty note: the holder may be between its lock and its note; look again first
                if notify is not None and (holder or waited):
                    notify(f"checkpointing.checkpoint_dir {str(root)!r} is held by {holder or 'another run'}; "
                           f"waiting up to "
                           f"{wait_s:g} s for it to end (a dead node's lock lasts until its lease expires; "
                           "checkpointing.claim_wait_s)")
                    notify = None
                waited = True
                time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
                continue
            # refused with a holder elsewhere: the wait ran out (not a live run found here after a look)
            after = f" after waiting {wait_s:g} s (checkpointing.claim_wait_s)" \
                if waited and _held_elsewhere(holder) else ""
            raise UserError(f"checkpointing.checkpoint_dir {str(root)!r} is in use by another run"
                            f"{f' ({holder})' if holder else ''}{after}; stop that run, or give this one its own "
                            "logger.log_dir (or checkpointing.checkpoint_dir)") from None
        try:  # the holder before us may have removed the file between our open and our lock
            same = os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        handle.close()
    handle.seek(0)
    handle.truncate()
    handle.write(_holder_note() + "\n")
    handle.flush()
    _HELD[path] = [handle, 1]
    return path


def release(token: str | None) -> None:
    """End a claim (idempotent per claim): the last holder removes the lock file, then unlocks."""
    if token is None or token not in _HELD:
        return
    _HELD[token][1] -= 1
    if _HELD[token][1] > 0:
        return
    handle, _ = _HELD.pop(token)
    try:
        os.unlink(token)  # while still locked: a waiting run then finds a new file (see claim)
    except OSError:
        pass
    handle.close()
