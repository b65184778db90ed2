"""A run sends Dask's messages at once on its own streams and puts back what it found on a user's cluster."""

from __future__ import annotations

from typing import Any

from distributed import Client, LocalCluster

from harmony.runtime.batching import UNBATCHED, unbatched


def _worker_interval(dask_worker: Any) -> float:
    return dask_worker.batched_stream.interval


def _scheduler_intervals(dask_scheduler: Any) -> dict[str, float]:
    streams = {**dask_scheduler.stream_comms, **dask_scheduler.client_comms}
    return {address: stream.interval for address, stream in streams.items()}


def intervals(client: Client) -> tuple[dict[str, float], dict[str, float], float]:
    return client.run(_worker_interval), client.run_on_scheduler(_scheduler_intervals), client.scheduler_comm.interval


def test_unbatched_streams_are_put_back_on_a_users_cluster() -> None:
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        before = intervals(client)
        used, other = sorted(before[0])
        assert set(before[0].values()) != {UNBATCHED}
        with unbatched(client, [used], restore=True):
            on_workers, on_scheduler, on_client = intervals(client)
            assert on_workers == {used: UNBATCHED, other: before[0][other]}, "only the run's workers change"
            assert on_scheduler[used] == on_scheduler[client.id] == on_client == UNBATCHED
            assert on_scheduler[other] == before[1][other]
        assert intervals(client) == before
