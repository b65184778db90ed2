"""Where a sampled process's threads spent their time: a summary of py-spy's raw (collapsed) stacks.

`py-spy record --subprocesses --threads --idle --format raw` writes one line per distinct stack, its frames from
the process and thread down to the sampled function, and how many samples it had. For the threads that ran a
Harmony task body (a device worker's task thread), or with --thread those whose name contains it, this prints their
samples, the functions that were on the stack in the largest share of them (inclusive) and those sampled running
(the leaf frames). --idle keeps the samples of a thread waiting (a lock, a sleep, the link), which a thread's own
time would otherwise hide. py-spy's thread names are not to be trusted: a thread started after another ended may
be shown with the ended one's name (a worker's task thread as "harmony-warmup"), hence the frames.

    py-spy record --subprocesses --threads --idle --format raw -o stacks.txt -- python -m benchmarks.gpu_swap ...
    python -m benchmarks.stacks stacks.txt [--thread NAME] [--top 40]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

LINE = re.compile(r":\d+\)")  # a frame's line number: a function counts once, wherever it was sampled


TASK = "task_body"  # a frame of every Harmony task's body (runtime.bodies)


def _thread(frames: list[str]) -> tuple[int, str] | None:
    """Where a stack's thread frame is, and the process and thread id it names (a thread's name aside)."""
    for index, frame in enumerate(frames[:3]):
        if frame.startswith("thread"):
            return index, ";".join(frames[:index]) + frame.split(")")[0]
    return None


def summary(lines: list[str], thread: str | None = None) -> tuple[int, Counter[str], Counter[str]]:
    """Samples of the matching threads (named so, or else those that ran a task body), and per function the samples
    it was on the stack in and the samples it was the running frame of."""
    stacks = []
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    tasked = {found[1] for frames, _ in stacks if (found := _thread(frames)) and any(TASK in f for f in frames)}
    total, inclusive, leaves = 0, Counter(), Counter()
    for frames, samples in stacks:
        found = _thread(frames)
        if found is None or not (thread in frames[found[0]] if thread else found[1] in tasked):
            continue
        calls = [LINE.sub(")", frame) for frame in frames[found[0] + 1:]]
        total += samples
        inclusive.update(dict.fromkeys(set(calls), samples))
        leaves[calls[-1] if calls else "(no Python frame)"] += samples
    return total, inclusive, leaves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--thread", help="threads whose name contains this (default: those that ran a task body)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    total, inclusive, leaves = summary(args.stacks.read_text().splitlines(), args.thread)
    print(f"{total} samples of " + (f"threads named *{args.thread}*" if args.thread else "task threads"))
    for title, counts in (("on the stack", inclusive), ("running", leaves)):
        print(f"-- {title}")
        for function, samples in counts.most_common(args.top):
            print(f"{samples:8d} {100 * samples / max(total, 1):5.1f}%  {function}")


if __name__ == "__main__":
    main()
