"""Who owns an engine's open round, and when a new trainer may take it over.

An engine refuses to open a round while another sync's round is open and fresh: two live trainers must not
interleave their chunks. A trainer killed mid-push (SIGKILL, an OOM kill, a lost node) leaves its round open
with no one to end it; its successor must not wait out the dead owner's timeout (rollouts would stop for
minutes after every orchestrated restart). So the owner id carries what proves its owner gone:

    "<random>|<host>|<boot id>|<pid>|<process start time>|<trainer id>"

* the same host (hostname and boot id) and that pid no longer running the process that made the id: gone;
* the same trainer id (`STREAMSYNC_TRAINER_ID`, a name that outlives restarts, e.g. the job and rank): the
  round is this trainer's own, from before its restart (one trainer id is one trainer at a time);
* otherwise (another host, no trainer id) the owner may be alive: its round is refused until it is idle for the
  timeout.

The taker ends the round as a failed one (the engine is mixed, so it is never taken for the old version) and
opens its own.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

TRAINER_ID_ENV = "STREAMSYNC_TRAINER_ID"


@dataclass(frozen=True)
class Owner:
    random: str
    host: str
    boot: str
    pid: int
    started: str
    trainer: str

    def __str__(self) -> str:
        return "|".join((self.random, self.host, self.boot, str(self.pid), self.started, self.trainer))

    def short(self) -> str:
        who = f"trainer {self.trainer}" if self.trainer else f"pid {self.pid} on {self.host}"
        return f"{self.random[:8]}, {who}"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _started(pid: int) -> str:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid, one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def new_owner() -> str:
    pid = os.getpid()
    return str(Owner(uuid.uuid4().hex, socket.gethostname(), _boot_id(), pid, _started(pid),
                     os.environ.get(TRAINER_ID_ENV, "").replace("|", "/")))


def parse(owner: object) -> Owner | None:
    parts = owner.split("|") if isinstance(owner, str) else []
    if len(parts) != 6 or not parts[3].isdigit():
        return None
    return Owner(parts[0], parts[1], parts[2], int(parts[3]), parts[4], parts[5])


def describe(owner: object) -> str:
    parsed = parse(owner)
    return parsed.short() if parsed is not None else str(owner)[:8]


def superseded(owner: object, me: str) -> str | None:
    """Why `owner`'s round may be taken over by `me` at once (its process is gone, or it is `me`'s trainer before
    a restart), or None."""
    other, mine = parse(owner), parse(me)
    if other is None or mine is None:
        return None
    if other.trainer and other.trainer == mine.trainer:
        return f"it is trainer {other.trainer}'s own round, from before a restart"
    same_machine = other.host == mine.host and other.boot and other.boot == mine.boot
    if same_machine and other.started and _started(other.pid) != other.started:
        return f"its process (pid {other.pid} on {other.host}) is gone"
    return None
