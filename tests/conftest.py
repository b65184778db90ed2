"""Shared helpers for the tests, and the suite-wide check that nothing Harmony started outlives it."""

from __future__ import annotations

import copy
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest
import torch
from torch import nn

import harmony
from harmony import calls, timings
from harmony.runtime import cluster
from harmony.runtime.cluster import shutdown
from harmony.runtime.hoststore import OWNER, PREFIX, HostStore, shm_directory
from harmony.runtime.orphans import owner_alive
from harmony.runtime.seeding import begin, reseed
from harmony.tasks.graph import TaskId, inputs, parse_key


def deep_mlp(width: int = 32, depth: int = 12, out: int = 4, seed: int = 0) -> nn.Sequential:
    """A model of many small layers, so a budget under half its parameters still fits a layer."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, out))
    return nn.Sequential(*layers)


class ResidualBlock(nn.Module):
    """A pre-norm residual block: its input is live across the whole block (no single value flows inside it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(self.norm(x))))


class ResidualNet(nn.Module):
    """Not a chain of its children: blocks in a ModuleList, a parameter read in forward, a flatten."""

    def __init__(self, width: int = 32, blocks: int = 12, inputs: int = 32, outputs: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(inputs, width)
        self.gain = nn.Parameter(torch.ones(width))
        self.blocks = nn.ModuleList([ResidualBlock(width) for _ in range(blocks)])
        self.head = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x) * self.gain
        for block in self.blocks:
            x = block(x)
        return self.head(torch.flatten(x, 1))


class MaskedSquares(nn.Module):
    """A forward torch.fx cannot trace (it iterates its input's shape) that keeps a tensor of a size its values set:
    the squares of its hidden units that are positive (masked_select), saved for the backward."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _ = tuple(x.shape)
        hidden = self.a(x)
        kept = torch.masked_select(hidden, hidden > 0)
        return self.b(hidden) + (kept * kept).sum() / batch


class FlattenedTokens(nn.Module):
    """OPT's shape: a forward torch.fx cannot trace (it iterates its input's shape), a stem and a block on (batch,
    length, width), blocks on the tokens flattened to (batch * length, width), a head on them viewed back. Past the
    first block no crossing tensor has the batch or the length alone: they cross the cuts as integers."""

    def __init__(self, width: int = 8, blocks: int = 3, outputs: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = tuple(x.shape)
        h = self.blocks[0](self.stem(x)).reshape(batch * length, width)
        for block in self.blocks[1:]:
            h = block(h).relu()
        return self.head(h.view(batch, length, width))


class GatedNet(nn.Module):
    """Blocks that all read a gate computed once from the input: several values flow between blocks."""

    def __init__(self, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width)
        self.blocks = nn.ModuleList([ResidualBlock(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.gate(x))
        for block in self.blocks:
            x = block(x) * gate
        return self.head(x)


class BatchBranch(nn.Module):
    """torch.fx cannot trace it (a branch on its batch's size): torch.export fixes that size at its sample's, and
    its graph computes another size's batch as the model does not."""

    def __init__(self, width: int = 32, out: int = 4, size: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.size = size
        self.a = nn.Linear(width, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(torch.tanh(self.b(h * 2 if h.shape[0] == self.size else h)))


class TiedEnds(nn.Module):
    """A chain whose last linear layer reads its first one's weight (a tie that spans packs under a small budget)
    and has a bias of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(32, 32, bias=False)
        self.middle = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
        self.last = nn.Linear(32, 32)
        self.last.weight = self.first.weight
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.last(self.middle(self.first(x))))


class ThreadsSeen(nn.Module):
    """A layer that records in buffers the fewest and the most threads torch computed its forward with."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fewest", torch.full((), float("inf")))
        self.register_buffer("most", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fewest.fill_(min(float(self.fewest), torch.get_num_threads()))
        self.most.fill_(max(float(self.most), torch.get_num_threads()))
        return x


def one_left_alone(**options: Any) -> list[nn.Sequential]:
    """Two small models, each led by a ThreadsSeen, homed on two CPU devices, the first for 2 steps and the second
    for 24 (so that its device computes alone after the first's has nothing left): trained with options to
    harmony.train, checked against plain PyTorch, and returned."""
    torch.manual_seed(0)
    models = [nn.Sequential(ThreadsSeen(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)) for _ in range(2)]
    references = [copy.deepcopy(model) for model in models]
    loaders = [[(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(steps)] for steps in (2, 24)]
    factory = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    result = harmony.train(models, loaders, nn.functional.mse_loss, factory, devices=2, steps_per_task=1,
                           fuse=False, progress=False, **options)
    assert {job.home for job in result.plan.jobs} == {"cpu-0", "cpu-1"}
    for model, reference, batches in zip(models, references, loaders):
        optimizer = factory(reference.parameters())
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            optimizer.step()
        assert_same_weights(model[1:], reference[1:])
    return models


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def regression_batches(samples: int, batch: int, width: int = 32, out: int = 4, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, width, generator=generator)
    y = torch.randn(samples, out, generator=generator)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, samples, batch)]


def sum_batches() -> list:
    """Four batches of 8 points in 4 dimensions whose target is their sum (from the global seed 0): what a linear
    model learns in a few steps."""
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]


def train_plain(
    model: nn.Module,
    batches: list,
    loss_fn: Callable[..., torch.Tensor],
    factory: Callable[..., torch.optim.Optimizer],
    epochs: int = 1,
) -> list[float]:
    """The plain PyTorch loop Harmony must match: one optimizer step per mini-batch."""
    optimizer = factory(model.parameters())
    losses = []
    for _ in range(epochs):
        for x, y in batches:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def assert_same_weights(trained: nn.Module, reference: nn.Module, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    for (name, a), (_, b) in zip(trained.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def clones(models: list[nn.Module]) -> list[nn.Module]:
    return [copy.deepcopy(m) for m in models]


def stashing_and_recomputing(
    model: nn.Module, batches: list, factory: Callable[..., torch.optim.Optimizer], reference: nn.Module,
    devices: Any, budget: int, packs_per_task: int = 1,
) -> dict[bool, tuple[nn.Module, Any]]:
    """A clone of model trained swapped under budget, packs_per_task packs a task, in two micro-batches, with
    stash=True and with stash=False, each checked within the budget and against reference (plain PyTorch's, in
    float64) and the two against each other bit for bit: per way, the trained clone and the result."""
    runs = {}
    for stash in (True, False):
        run = clones([model])
        result = harmony.train(run, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                               devices=devices, device_memory=budget, resident=False, fuse=False,
                               packs_per_task=packs_per_task, stash=stash, progress=False)
        assert len(result.plan.jobs[0].packing.packs) > 2
        assert max(result.stats.peak_device_bytes.values()) <= budget
        assert_same_weights(run[0], reference, rtol=1e-9, atol=1e-12)
        runs[stash] = run[0], result
    recomputed = runs[False][0].state_dict()
    for name, stashed in runs[True][0].state_dict().items():
        assert torch.equal(stashed, recomputed[name]), name
    return runs


def train_plain_seeded(model: nn.Module, batches: list, optimizer: torch.optim.Optimizer, job: int,
                       drawing: tuple[int, ...], microbatches: int, device: str = "cpu") -> None:
    """The plain micro-batched loop that draws harmony's masks: each micro-batch's forward begins the job's
    streams (runtime.seeding) on device, where the model and batches are, and the drawing layers of the chain (a
    Sequential's children) reseed."""
    reseed(model, 0, drawing)
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad()
        size = len(x) // microbatches
        for microbatch, (xs, ys) in enumerate(zip(x.split(size), y.split(size))):
            begin(torch.device(device), job, step, microbatch)
            (nn.functional.mse_loss(model(xs), ys) / microbatches).backward()
        optimizer.step()


def train_plain_scheduled(
    model: nn.Module, batches: list, factory: Callable[..., torch.optim.Optimizer], microbatches: int = 1,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, clip: float | None = None,
) -> tuple[torch.optim.Optimizer, list[float]]:
    """The plain loop with a learning-rate scheduler and clipping that Harmony must match: each batch's micro-batches
    backward (their shares of the MSE), clip_grad_norm_ where clip is given, optimizer.step(), then the step of the
    scheduler built on the optimizer where given (LambdaLR, a transformers schedule). Trains model in place; returns
    the optimizer and the norms clip_grad_norm_ returned."""
    optimizer = factory(model.parameters())
    stepping = scheduler(optimizer) if scheduler is not None else None
    norms = []
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (nn.functional.mse_loss(model(xs), ys) * (len(xs) / len(x))).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        if stepping is not None:
            stepping.step()
    return optimizer, norms


def train_plain_scaled(model: nn.Module, batches: list, factory: Callable[..., torch.optim.Optimizer],
                       microbatches: int, scaler_arguments: dict, schedule: Callable[[int], float] | None = None,
                       clip: float | None = None) -> tuple[torch.amp.GradScaler, int, list[float]]:
    """The plain fp16 loop Harmony must match: micro-batches under autocast(float16), torch.amp.GradScaler; with
    clip, GradScaler.unscale_ then clip_grad_norm_ before the step; with schedule, LambdaLR.step() after it (also after
    a skipped one). Trains model in place; returns the scaler, the steps it skipped and the norms clip_grad_norm_
    returned."""
    optimizer = factory(model.parameters())
    scaler = torch.amp.GradScaler("cpu", **scaler_arguments)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule is not None else None
    skipped, norms = 0, []
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(xs), ys) * (len(xs) / len(x))
            scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if scheduler is not None:
            scheduler.step()
        skipped += scaler.get_scale() < before
    return scaler, skipped, norms


def harmony_files() -> list[str]:
    return sorted(p.name for p in shm_directory().glob(f"{PREFIX}*"))


def described(names: set[str] | list[str]) -> str:
    """Leftover files by run, each run's owner record and whether its owner still runs, and the device workers alive:
    what a leak's failure message needs to tell which process should have removed them."""
    runs: dict[str, int] = {}
    for name in names:
        run = name[len(PREFIX):].split("-", 1)[0]
        runs[run] = runs.get(run, 0) + 1
    lines = []
    for run, count in sorted(runs.items()):
        owner = HostStore(run).read_bytes(OWNER)
        if owner is None:
            lines.append(f"run {run}: {count} files, no owner record")
        else:
            state = "alive" if owner_alive(owner) else "gone"
            lines.append(f"run {run}: {count} files, owner {owner.decode()} ({state})")
    alive = [(p.pid, p.ppid(), p.status()) for p in worker_processes() if p.is_running()]
    return "; ".join(lines) + f"; workers alive (pid, parent, status): {alive}"


def portrayed(pids: set[int]) -> str:
    """Processes by what tells a worker left alive from another that took its process id: name, status, parent,
    age and command line."""
    lines = []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                lines.append(f"{pid} ({process.name()}, {process.status()}, parent {process.ppid()}, "
                             f"{time.time() - process.create_time():.1f} s old, {process.num_threads()} threads: "
                             f"{' '.join(process.cmdline())[:160]})")
        except psutil.Error as error:
            lines.append(f"{pid} ({type(error).__name__})")
    return "; ".join(lines)


def native_threads() -> set[int]:
    """Ids of the calling process's threads that Python did not start: torch's OpenMP pool threads among them."""
    started_by_python = {thread.native_id for thread in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - started_by_python


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch computes with count CPU threads for the block (threads started in it included)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def worker_processes() -> list[psutil.Process]:
    """Dask worker processes started by Harmony that are still alive, whoever their parent is now: started as
    processes of their own, or forked from a zygote (runtime.zygote names them)."""
    found = []
    for process in psutil.process_iter(["cmdline", "name"]):
        cmdline = process.info.get("cmdline") or []
        if any("distributed.cli.dask_spec" in part for part in cmdline) or process.info.get("name") == "harmony-device":
            found.append(process)
    return found


def started_by(pid: int, processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of processes that process pid started, itself or through a process it started (a worker its
    zygote forked)."""
    found = []
    for process in processes:
        try:
            if pid in {parent.pid for parent in process.parents()}:
                found.append(process)
        except psutil.Error:
            continue
    return found


def zygotes() -> list[psutil.Process]:
    """Zygote processes (runtime.zygote) that still run."""
    return [process for process in psutil.process_iter(["cmdline", "name", "status"])
            if any("harmony.runtime.zygote" in part for part in process.info.get("cmdline") or [])
            and process.info.get("name") != "harmony-device" and process.info.get("status") != psutil.STATUS_ZOMBIE]


def live_workers() -> list[psutil.Process]:
    """The worker processes of worker_processes that still run (a zombie has ended, reaped or not)."""
    return [p for p in worker_processes() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(autouse=True, scope="session")
def nothing_outlives_the_suite() -> Iterator[None]:
    """After every test has run and the warm cluster is shut down (as harmony.shutdown() or the interpreter's exit
    does), no shared-memory file of Harmony's and no device worker may remain."""
    yield
    shutdown()
    leftover_files = harmony_files()
    alive = live_workers()
    assert not leftover_files, f"shared-memory files left behind: {described(leftover_files)}"
    assert not alive, f"worker processes left alive: {[p.pid for p in alive]}"
    assert not zygotes(), f"zygotes left alive: {[p.pid for p in zygotes()]}"


def warm_workers() -> set[int]:
    """The process ids of the warm embedded cluster's device workers (none without one): those registered with its
    scheduler, and those its cluster started that have not registered yet (a killed worker starting again)."""
    warm = cluster.WARM
    if warm is None:
        return set()
    started = [] if warm[1].cluster is None else warm[1].cluster.workers.values()
    return set(warm[1].client.run(os.getpid).values()) | {
        worker.process.pid for worker in started if getattr(worker, "process", None) is not None}


@pytest.fixture(autouse=True)
def warm_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests keep the embedded cluster warm between them, as a notebook's re-run calls do (a cold start is seconds of
    two cores' time, most of this suite's once); a test that failed closes it, its workers being in any state."""
    failures = request.session.testsfailed
    yield
    if request.session.testsfailed > failures:
        shutdown()


@pytest.fixture
def no_cluster_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a test of harmony.plan alone: starting the embedded cluster fails it."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("harmony.plan started a cluster")

    monkeypatch.setattr("harmony.api.embedded", refuse)


@pytest.fixture(autouse=True)
def fresh_timings(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every test plans from timings of its own: none kept from an earlier test's calls (harmony.timings, and the
    host costs runs fitted, harmony.calls), whose pinned or measured timings it would otherwise take, nor from the
    user's cache directory (each test's processes keep their runs' figures in a directory of its own)."""
    timings.forget()
    calls.forget()
    monkeypatch.setenv("HARMONY_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def cold_start() -> None:
    """For a test whose own processes run Harmony: this process's warm cluster is shut down first, so that it holds
    neither the dashboard's default port (theirs would warn that it is taken) nor cores they would compete for."""
    shutdown()


@pytest.fixture
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """The same check around one test, so the test that leaks is the one that fails: no shared-memory file left
    behind, and no worker process alive but the warm cluster's, which a run that ended well keeps (the suite's end
    checks that shutting it down leaves nothing)."""
    before = set(harmony_files())
    failures = request.session.testsfailed
    yield
    if request.session.testsfailed > failures:
        shutdown()
    left = set(harmony_files()) - before
    assert not left, f"this test left shared-memory files behind: {described(left)}"
    alive = {p.pid for p in live_workers()}
    left_alive = alive - warm_workers()
    assert not left_alive, f"this test left worker processes alive: {portrayed(left_alive)}"


@pytest.fixture
def steady_pilot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pilot's layer timings pinned, a nanosecond per parameter: the plan (where the chain is cut, which packs
    stash) is then the same on a loaded machine as on an idle one, where a test's assertions depend on it."""
    from harmony.runtime import pilot

    def timed(layer: nn.Module, x: object, repeats: int) -> tuple[object, float]:
        return layer(x), 1e-9 * (1 + sum(p.numel() for p in layer.parameters()))

    monkeypatch.setattr(pilot, "_fastest_call", timed)
    monkeypatch.setattr(pilot, "_as_chained", lambda profiles, *_: profiles)


@pytest.fixture
def timed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The repeats the pilot asks of each layer's timing (runtime.pilot._fastest_call), in the order asked."""
    from harmony.runtime import pilot

    calls: list[int] = []
    fastest = pilot._fastest_call

    def counted(layer: nn.Module, x: object, repeats: int) -> tuple[object, float]:
        calls.append(repeats)
        return fastest(layer, x, repeats)

    monkeypatch.setattr(pilot, "_fastest_call", counted)
    return calls


@pytest.fixture
def store() -> Iterator[HostStore]:
    """A host store of its own for a unit test, removed after it."""
    host = HostStore("unittest")
    yield host
    host.unlink_all()


def stop(processes: list[subprocess.Popen]) -> None:
    """End processes a test started (a scheduler, then its workers): each terminated in reverse order once the one
    before has ended, killed after 30 s. A worker ends at once while its scheduler answers; terminated together, a
    worker that finds its scheduler gone first may wait out distributed's connect timeout (30 s) before it ends."""
    for process in reversed(processes):
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cross_device_reads(schedule: dict[str, list[str]]) -> int:
    """How many times a fwd or bwd task read a result that a task on another device produced, from a run's
    schedule (per device, the keys it ran)."""
    where = {parsed[0]: device for device, keys in schedule.items() for key in keys
             if (parsed := parse_key(key)) is not None}
    sections = {task.model: 1 + max(t.pack for t in where if t.model == task.model) for task in where}
    return sum(1 for task, device in where.items() for value in inputs(task, sections[task.model])
               if isinstance(value, TaskId) and where[value] != device)
