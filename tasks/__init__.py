"""Pure planning for Harmony: decomposition, packing, task graph and binding, with no Dask, devices or I/O."""
