"""`delta="auto"` on a link: whether a push goes as a delta, from what this sync measured of its own pushes.

Deltas are on under "auto" only where the transport's link is the bound (`Transport.delta_pays`); where the
receiver reads the sender's memory (CUDA IPC, shared memory) finding the changes reads as many bytes as the copy
they save, and no push of such a sync is a delta. On a link, whether a delta pays depends on the link's rate,
the codec's rate on each side and how much changed, all of which this sync sees in its own pushes: the seconds
of its last full push (the model's bytes over them: the link's rate as a push sees it) and of its last delta (the
whole call, encode, link and decode included; its bytes at that rate are its link share, the rest the codec's),
and the share of elements the last delta found changed. A push goes as a delta while the last delta was faster
than the last full push; after a delta that was slower, pushes go in full
and a delta is tried again every `PROBE_EVERY` of them (the density and the link change as training goes on).
Each decision and its reason are in the report (`report.delta.auto`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: full pushes chosen for cost between two tries of a delta
PROBE_EVERY = 8


@dataclass
class AutoDelta:
    #: seconds of this sync's last full push and last delta push (None: none yet)
    full_s: float | None = None
    delta_s: float | None = None
    #: the link's rate as the last full push saw it (the model's bytes over its seconds: fixed costs included)
    link_Bps: float | None = None
    #: the last delta's share of elements changed and its bytes on the wire against the model's
    changed: float = 0.0
    wire_share: float = 0.0
    #: of the last delta's seconds, what its bytes took on the link at `link_Bps`; the rest is the codec's
    wire_s: float | None = None
    #: full pushes chosen for cost since the last delta
    fulls: int = 0

    def note(self, mode: str, seconds: float, wire_bytes: int, model_bytes: int, changed: float) -> None:
        """A push of this sync succeeded: keep what it cost."""
        if mode == "full":
            self.full_s = seconds
            self.link_Bps = model_bytes / seconds if seconds > 0 and model_bytes else None
            return
        self.delta_s, self.fulls = seconds, 0
        self.changed, self.wire_share = changed, wire_bytes / model_bytes if model_bytes else 0.0
        self.wire_s = min(seconds, wire_bytes / self.link_Bps) if self.link_Bps else None

    def choose(self) -> tuple[bool, str]:
        """(whether a delta may go, why), once every other rule allows one."""
        if self.full_s is None or self.delta_s is None:
            return True, "auto: no delta measured yet on this link: trying one"
        split = ""
        if self.wire_s is not None and self.link_Bps is not None:
            split = (f": {self.wire_s:.3f} s of bytes at the link's {self.link_Bps / 1e9:.2f} GB/s, "
                     f"{self.delta_s - self.wire_s:.3f} s encoding and decoding")
        said = (f"the last delta took {self.delta_s:.3f} s ({self.changed:.1%} changed, {self.wire_share:.1%} of "
                f"the bytes{split}), the last full push {self.full_s:.3f} s")
        if self.delta_s < self.full_s:
            return True, f"auto: {said}"
        if self.fulls >= PROBE_EVERY:
            return True, f"auto: {said}; trying a delta again after {self.fulls} full pushes"
        self.fulls += 1
        return False, f"auto: {said}; a delta is tried again after {PROBE_EVERY - self.fulls + 1} more full pushes"
