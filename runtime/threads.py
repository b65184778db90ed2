"""A CPU device's threads, one or all of its share, chosen by timing its own tasks both ways.

A CPU device computes with a team of threads (OpenMP) on the host's cores, which it shares with its worker's
event loop, the driver and the scheduler. A parallel region waits for the slowest thread of its team, so where one
of them is descheduled to let the runtime's own work run, every op waits for it (letting idle threads sleep at once,
OMP_WAIT_POLICY=PASSIVE, did not help): a run of short tasks, whose runtime work never stops, can take half as long
again with two threads as with one, while a long task's large multiplies gain from the team
(docs/performance.md, "One thread or all"). Tasks that run with a team slow the tasks around them too, so the
device chooses for all of its tasks at once. Which way is faster depends on the layers, the tasks' length and the
machine, so each device times it: the occurrences of each fwd and bwd task of one step (kind, job, pack: a step
apart, the same work; a homed job's tasks of several steps are long, few and run with all threads) alternate
between all of its threads and one, the first of each left out (the run's start slows it); each task is timed
from its start to the next task's (what it cost the device, the runtime's work after it included); consecutive
occurrences of a task give the ratio of their seconds, and once PAIRS ratios are in (or AGREEING, all on one side
of one), the device keeps one thread if their median is below one, else all, until its share of threads changes
(an idle device gives its own). A device of one thread has nothing to choose.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PAIRS = 16  # the ratios a device is timed for before its choice
AGREEING = 4  # as many ratios all on one side of one choose sooner (a run of few tasks would time most of them)
SKIP = 1  # each task's first occurrences left out of the timing: the run's first step (first touches, warm-up)
TaskKey = tuple[str, int, int]  # a task's kind, job and pack: its occurrences, a step apart, do the same work


@dataclass
class Threads:
    """One device's choice between one thread and all of its share, and the timings it is made from:
    threads_for before a task, finished when the device's next task starts."""

    pairs: int = PAIRS
    share: int = 0  # the device's threads that the choice, or the timing, is for
    one: bool | None = None  # the choice: True, one thread; None, still timing
    ratios: list[float] = field(default_factory=list)  # one thread's seconds over all threads', per pair
    last: dict[TaskKey, tuple[bool, float]] = field(default_factory=dict)  # an unpaired occurrence: (one, seconds)
    count: dict[TaskKey, int] = field(default_factory=dict)  # occurrences started

    def threads_for(self, key: TaskKey, threads: int) -> int:
        """The threads task key runs with on a device whose share is threads now: as chosen, else, while timing,
        all of them on its even occurrences and one on its odd ones. A share other than the one the choice was made
        for (threads an idle device gave, runtime.devices.shared_threads) times afresh."""
        if threads != self.share:
            self.share, self.one = threads, None
            self.ratios, self.last, self.count = [], {}, {}
        if threads == 1:
            return 1
        if self.one is not None:
            return 1 if self.one else threads
        occurrence = self.count.get(key, 0)
        self.count[key] = occurrence + 1
        return 1 if occurrence % 2 else threads

    def finished(self, key: TaskKey, threads: int, share: int, seconds: float) -> bool | None:
        """Record that task key took seconds of the device with threads of its share then (threads_for): a pair's
        ratio with its last unpaired occurrence, and the choice once there are pairs of them, which it returns
        (True: one thread; None: no choice made now, or the share has changed since)."""
        if share != self.share or share == 1 or self.one is not None or self.count.get(key, 0) <= SKIP:
            return None
        one = threads == 1
        unpaired = self.last.pop(key, None)
        if unpaired is None or unpaired[0] == one:
            self.last[key] = (one, seconds)
            return None
        single, every = (seconds, unpaired[1]) if one else (unpaired[1], seconds)
        self.ratios.append(single / every if every > 0 else 1.0)
        if not self.timed:
            return None
        self.one = statistics.median(self.ratios) < 1.0
        self.last.clear()
        return self.one

    @property
    def timed(self) -> bool:
        """Whether the ratios are enough to choose by: pairs of them, or AGREEING all on one side of one."""
        agree = len(self.ratios) >= AGREEING and len({ratio < 1.0 for ratio in self.ratios}) == 1
        return len(self.ratios) >= self.pairs or agree

    def validate_state(self) -> None:
        """Chosen once the ratios are enough (timed), and nothing left unpaired after."""
        assert (self.one is not None) == self.timed, self.ratios
        assert self.one is None or not self.last
