"""Execution for Harmony: the Dask cluster, the host store, device workers and the late-binding driver."""
