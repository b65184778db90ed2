"""Where a traced device's time went: a summary of a profile_steps Chrome trace (runtime/profiling.py).

For each trace: the window from its first event to its last, the time inside tasks (the ranges named by Dask keys,
by task kind), the GPU's kernels, copies and fills (their total and the union of their intervals: how long the GPU
was busy at all, and each stream), host-to-device and device-to-host bytes, and the host ops that took longest
(an op's time includes the ops it called). For each host thread, the time inside its outermost ops and the time
between them inside tasks (Python's own work, or waits: where it is large, kernels are launched slower than they
run);
and the pauses, windows of over 2 ms in which no thread ran an op and the GPU did nothing (a garbage collection,
a lock, the profiler).

    python -m benchmarks.trace_summary traces/*/profile-*.json [--top 15]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

GPU = ("kernel", "gpu_memcpy", "gpu_memset")


def union(intervals: list[tuple[float, float]]) -> float:
    """The length covered by intervals (start, end)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def summary(events: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """The summary of one trace's complete events (microseconds in, seconds out)."""
    spans = [event for event in events if event.get("ph") == "X" and "dur" in event]
    window = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e6 if spans else 0.0
    tasks: dict[str, list[float]] = defaultdict(list)
    gpu: dict[str, list[tuple[float, float]]] = defaultdict(list)
    streams: dict[str, list[tuple[float, float]]] = defaultdict(list)
    copied: dict[str, int] = defaultdict(int)
    host: dict[str, float] = defaultdict(float)
    threads: dict[str, list[tuple[float, float]]] = defaultdict(list)
    ranges: list[tuple[float, float]] = []
    for event in spans:
        category, name = event.get("cat", ""), event.get("name", "")
        interval = (event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6)
        if category == "user_annotation" and "-" in name:  # a task's range, named by its Dask key
            tasks[name.split("-")[0]].append(event["dur"] / 1e6)
            ranges.append(interval)
        elif category in GPU:
            gpu[category].append(interval)
            streams[str(event.get("args", {}).get("stream", event.get("tid")))].append(interval)
            if category == "gpu_memcpy":
                copied[name] += int(event.get("args", {}).get("bytes", 0))
        elif category == "cpu_op":
            host[name] += event["dur"] / 1e6
            threads[str(event.get("tid"))].append(interval)
    every = [interval for intervals in gpu.values() for interval in intervals]
    return {
        "window s": window,
        "tasks": {kind: {"count": len(seconds), "seconds": sum(seconds)} for kind, seconds in tasks.items()},
        "gpu busy s": union(every),
        "gpu s": {category: sum(end - start for start, end in intervals) for category, intervals in gpu.items()},
        "stream busy s": {stream: union(intervals) for stream, intervals in streams.items()},
        "copied bytes": dict(copied),
        "host ops s": dict(sorted(host.items(), key=lambda item: -item[1])[:top]),
        "host threads s": {thread: outermost(intervals, ranges) for thread, intervals in threads.items()},
        "pauses s": pauses(every + [interval for intervals in threads.values() for interval in intervals]),
    }


def outermost(intervals: list[tuple[float, float]], tasks: list[tuple[float, float]]) -> dict[str, float]:
    """One thread's time inside its outermost ops, and the time inside tasks between them."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    between = sum(max(0.0, min(following[0], task_end) - max(before[1], task_start))
                  for before, following in pairwise(merged) for task_start, task_end in tasks)
    return {"in ops": sum(end - start for start, end in merged), "between ops in tasks": between}


def pauses(intervals: list[tuple[float, float]], longer: float = 0.002) -> list[float]:
    """The gaps longer than longer seconds between intervals (start, end), in order of their start."""
    gaps, reach = [], float("inf")
    for start, end in sorted(intervals):
        if start - reach > longer:
            gaps.append(start - reach)
        reach = end if reach == float("inf") else max(reach, end)
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15, help="how many of the longest host ops to list")
    args = parser.parse_args()
    for path in args.traces:
        trace = json.loads(path.read_text())
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        print(f"== {path}")
        print(json.dumps(summary(events, args.top), indent=1))


if __name__ == "__main__":
    main()
