"""Where a sampled process's threads spent their time: a summary of py-spy's raw (collapsed) stacks.

`py-spy record --subprocesses --threads --idle --format raw` writes one line per distinct stack, its frames from
the process and thread down to the sampled function, and how many samples it had. For the threads whose name
contains --thread (a Dask worker's task thread by default), this prints their samples, the functions that were
on the stack in the largest share of them (inclusive) and those sampled running (the leaf frames). --idle keeps
the samples of a thread waiting (a lock, a sleep, the link), which a thread's own time would otherwise hide.

    py-spy record --subprocesses --threads --idle --format raw -o stacks.txt -- python -m benchmarks.gpu_swap ...
    python -m benchmarks.stacks stacks.txt [--thread Dask-Default-Threads] [--top 40]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

LINE = re.compile(r":\d+\)")  # a frame's line number: a function counts once, wherever it was sampled


def summary(lines: list[str], thread: str) -> tuple[int, Counter[str], Counter[str]]:
    """Samples of the matching threads, and per function the samples it was on the stack in and the samples it
    was the running frame of."""
    total, inclusive, leaves = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        where = [index for index, frame in enumerate(frames[:3]) if frame.startswith("thread") and thread in frame]
        if not where:
            continue
        calls = [LINE.sub(")", frame) for frame in frames[where[0] + 1:]]
        samples = int(count)
        total += samples
        inclusive.update(dict.fromkeys(set(calls), samples))
        leaves[calls[-1] if calls else "(no Python frame)"] += samples
    return total, inclusive, leaves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stacks", type=Path)
    parser.add_argument("--thread", default="Dask-Default-Threads", help="threads whose name contains this")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    total, inclusive, leaves = summary(args.stacks.read_text().splitlines(), args.thread)
    print(f"{total} samples of threads named *{args.thread}*")
    for title, counts in (("on the stack", inclusive), ("running", leaves)):
        print(f"-- {title}")
        for function, samples in counts.most_common(args.top):
            print(f"{samples:8d} {100 * samples / max(total, 1):5.1f}%  {function}")


if __name__ == "__main__":
    main()
