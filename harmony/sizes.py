"""Byte sizes as users write them: 1_000_000, "512MB", "2GiB", "12GB/s"."""

from __future__ import annotations

from dask.utils import parse_bytes


def parse_size(value: int | float | str, argument: str) -> int:
    """Bytes from an int or a string such as "512MB" or "2GiB"; a clear error for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{argument}={value!r} is not a size; pass bytes as an int or a string like '512MB'")
    if isinstance(value, (int, float)):
        size = int(value)
    elif isinstance(value, str):
        try:
            size = int(parse_bytes(value.strip()))
        except (ValueError, TypeError, KeyError):
            raise ValueError(
                f"{argument}={value!r} is not a size Harmony can read; use bytes as an int or a string "
                "like '512MB', '1.5GB' or '2GiB'"
            ) from None
    else:
        raise ValueError(f"{argument}={value!r} is not a size; pass bytes as an int or a string like '512MB'")
    if size <= 0:
        raise ValueError(f"{argument}={value!r} must be a positive number of bytes")
    return size


def parse_bandwidth(value: int | float | str, argument: str) -> float:
    """Bytes per second from a number or a string such as "12GB/s" or "500 MiB/s"."""
    text = value.strip().removesuffix("/s").removesuffix("ps") if isinstance(value, str) else value
    return float(parse_size(text, argument))


def parse_bandwidths(value: object, devices: int) -> list[float | None]:
    """One link speed per device from None, one speed for all, or a list with one per device."""
    if value is None:
        return [None] * devices
    if isinstance(value, (list, tuple)):
        if len(value) != devices:
            raise ValueError(f"link_bandwidth has {len(value)} entries for {devices} devices; give one per device")
        return [None if v is None else parse_bandwidth(v, f"link_bandwidth[{i}]") for i, v in enumerate(value)]
    return [parse_bandwidth(value, "link_bandwidth")] * devices  # type: ignore[arg-type]
