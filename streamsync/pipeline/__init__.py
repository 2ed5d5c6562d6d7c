"""The five-stage push pipeline: gather -> convert -> pack -> send -> release.

Each stage is a short coroutine that takes a chunk from its inbox and hands it on; stages are joined by
bounded anyio memory streams and run in one task group. A credit window bounds the chunks alive anywhere:
gather takes a credit before it touches a chunk, release gives it back after every receiver acknowledged
and the buffer is freed. So the sender's extra memory is at most `max_inflight` packed chunks.

Any failure cancels the task group; the push raises one PushError naming stage, chunk and receiver, and
every buffer still alive is freed.

Timeouts: one watchdog task per push, not a cancel scope per stage and chunk. Each stage notes when it
took up a chunk; the watchdog fails the push when any stage has worked on one chunk longer than `timeout`.
(A cancel scope costs tens of microseconds to enter and leave; five per chunk were a measurable share of
a GPU push's host time.) Waiting for a queue slot or a credit is not timed: it ends when a later stage
moves on, and that stage is timed."""

from .job import STAGES, Push, PushJob, Work
from .profiler import ProfilerRange
from .stages import check_converted, first_push_error, run

__all__ = ["STAGES", "ProfilerRange", "Push", "PushJob", "Work", "check_converted", "first_push_error",
           "run"]
