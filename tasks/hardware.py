"""What the simulator knows of the hardware a run is predicted on: compute speed, links and per-task costs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """What a device can do: compute relative to the pilot machine, and link speeds in bytes per second.

    compute_scale 1.0 means as fast as the machine that ran the pilot pass; host_link is host<->device
    (None: copies cost nothing), peer_link device<->device; task_overhead is the runtime's fixed cost
    per task (Dask's scheduling, about a millisecond on a server, a few on a small machine); edge_seconds is how long
    a task's result takes to reach a reader on another device (the scheduler's edge and the fetch between their
    workers), where a reader on the same device has it at once; task_cpu is the
    CPU time a task takes from the cores the devices compute with (the driver's, the scheduler's and the
    worker's work for it; 0 where the devices compute elsewhere); shared_cores says the devices compute on the
    host's cores (CPU devices), so that work on a host thread beside a device (an overlapped update) takes its
    time from the device's compute instead of hiding behind it. call_seconds is the runtime's host work per pack
    call of a swapped job (one micro-batch through a pack's forward, its recompute or its backward; the simulator
    counts a task's calls): binding the weights, claiming and copying values, bookkeeping, and on a GPU the
    kernels' launches. On CPU devices it adds to the compute; on a GPU it runs while the kernels queued before
    it run, so that a task takes the longer of the two (with_calls). handling_seconds is the runtime's work per
    task that task_overhead, timed on the idle cluster, does not show: the driver binding and submitting it, the
    worker taking its values in and its results out, on a machine whose cores the devices compute with; it lies
    between a device's tasks, where call_seconds lies inside them. update_call_seconds is the runtime's work per
    update of a swapped pack, on the host store or on its device, besides the optimizer's passes over its bytes (and
    a device update's state copies): taking the pack's lock, checking its files, copying the slot and the state
    across, publishing the version, the optimizer's own per-step work; a fixed cost per pack and step that small
    packs feel. The pilot's times contain none of them; a run measures the last (its workers time their updates) and
    fits the others (harmony.calls: the call cost to its tasks' durations, the cost per task to the rest of the
    step), and later plans take them.
    """

    name: str = "this machine"
    compute_scale: float = 1.0
    host_link: float | None = None
    peer_link: float | None = None
    task_overhead: float = 0.003
    edge_seconds: float = 0.005
    task_cpu: float = 0.0
    optimizer_bytes_per_second: float = 5e9
    shared_cores: bool = False
    call_seconds: float = 0.0
    handling_seconds: float = 0.0
    update_call_seconds: float = 0.0

    @property
    def edge_cost(self) -> float:
        """How long after its task ends a result reaches a task on another device: the edge, and a task's handling."""
        return self.edge_seconds + self.handling_seconds

    @property
    def task_cost(self) -> float:
        """What a task costs a device besides its work: Dask's per task (or the CPU time it takes, where more) and
        the runtime's handling of it."""
        return max(self.task_overhead, self.task_cpu) + self.handling_seconds

    def with_calls(self, compute: float, calls: int) -> float:
        """Seconds of work of which compute is the kernels' and calls the pack calls the runtime makes for them
        (call_seconds each): after the compute on CPU devices (shared_cores), beside it on a GPU."""
        host = calls * self.call_seconds
        return compute + host if self.shared_cores else max(compute, host)
