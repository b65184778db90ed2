"""torch.profiler traces of the device workers' tasks (profile_steps): which tasks, under what names, whose file."""

from __future__ import annotations

import json
import re
import stat
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import harmony
from harmony.runtime.profiling import TaskProfiler
from tests.conftest import deep_mlp, regression_batches


def test_each_device_traces_its_tasks_of_the_steps_asked_under_their_keys(tmp_path: Path, no_leaks: None) -> None:
    """Two models (one swapped in several packs) on two CPU devices, profile_steps=2: every device's trace holds the
    ranges of its tasks of steps 1 and 2, named by their keys, around the ops they ran, and no other step's task."""
    models = [deep_mlp(seed=0), deep_mlp(depth=2, seed=1)]
    batches = regression_batches(samples=16 * 6, batch=16)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.05), devices=["cpu", "cpu"],
                           device_memory=30_000, fuse=False, progress=False, log_dir=tmp_path, profile_steps=2,
                           packs_per_task=1, steps_per_task=1)
    assert result.plan.jobs[0].home is None and len(result.packings[0].packs) > 2
    traced: set[str] = set()
    for device in ("cpu-0", "cpu-1"):
        path = tmp_path / f"profile-{device}.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, "the trace is its owner's alone"
        events = json.loads(path.read_text())["traceEvents"]
        names = {event.get("name", "") for event in events}
        ranges = {name for name in names if re.match(r"(fwd|bwd|upd)-", name)}
        ran = set(result.stats.schedule[device])
        assert ranges and ranges <= ran, "only this device's tasks"
        assert {int(re.search(r"-s(\d+)", name).group(1)) for name in ranges} <= {1, 2}  # type: ignore[union-attr]
        assert any(name.startswith("aten::") for name in names), "the ops inside the tasks"
        traced |= ranges
    step_of = {key: int(re.search(r"-s(\d+)", key).group(1)) for keys in result.stats.schedule.values()  # type: ignore[union-attr]
               for key in keys if re.match(r"(fwd|bwd)-", key)}
    assert {key for key, step in step_of.items() if step in (1, 2)} <= traced, "every task of the profiled steps"


def test_profiling_needs_a_log_dir_and_a_count_of_steps(tmp_path: Path) -> None:
    model, batches = deep_mlp(depth=2), regression_batches(32, 16)
    with pytest.raises(harmony.InputError, match="log_dir"):
        harmony.train(model, batches, profile_steps=2, progress=False)
    with pytest.raises(harmony.InputError, match="profile_steps"):
        harmony.train(model, batches, profile_steps=-1, log_dir=tmp_path, progress=False)
    idle = TaskProfiler(None, 3, "cpu-0", cuda=False, models=1)
    with idle.task("fwd-m0-p0-s1", 0, 1):
        pass
    idle.finish()
    assert not idle.events and not list(tmp_path.iterdir())


def test_tasks_on_other_threads_land_in_one_trace_and_a_task_past_the_steps_writes_it(tmp_path: Path) -> None:
    """An upd task secedes and the worker's next tasks run on another thread: each task's own session, one trace.
    Once both models of the run have started a task past the profiled step, the trace is written."""
    profiler = TaskProfiler(str(tmp_path), 1, "cuda-0", cuda=False, models=2)

    def task(key: str, model: int, step: int) -> None:
        with profiler.task(key, model, step):
            torch.mm(torch.randn(64, 64), torch.randn(64, 64))

    for key, model in (("fwd-m0-p0-s1-run", 0), ("upd-m1-p0-s1-run", 1)):
        worker = threading.Thread(target=task, args=(key, model, 1))
        worker.start()
        worker.join()
    task("fwd-m0-p0-s0-run", 0, 0)
    task("fwd-m0-p0-s2-run", 0, 2)
    assert not (tmp_path / "profile-cuda-0.json").exists(), "model 1 is still in the profiled step"
    task("fwd-m1-p0-s2-run", 1, 2)
    events = json.loads((tmp_path / "profile-cuda-0.json").read_text())["traceEvents"]
    names = [event.get("name") for event in events]
    assert names.count("fwd-m0-p0-s1-run") == names.count("upd-m1-p0-s1-run") == 1
    assert "aten::mm" in names and not any("-s0-" in str(name) or "-s2-" in str(name) for name in names)
    assert [path.name for path in tmp_path.iterdir()] == ["profile-cuda-0.json"], "no session file left behind"
