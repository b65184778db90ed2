"""Print a benchmark's rows as a table and write them, with the machine's description, as JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def arguments(description: str, extend: Callable[[argparse.ArgumentParser], None] | None = None
              ) -> argparse.Namespace:
    """The options every benchmark takes (--out, --quick), plus those extend adds. A benchmark starts cold: the host
    costs earlier processes fitted (harmony.fitfiles) are neither read nor written, unless HARMONY_CACHE_DIR is set."""
    os.environ.setdefault("HARMONY_CACHE_DIR", "")
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON (default benchmarks/results/)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and sizes, for a smoke run")
    if extend is not None:
        extend(parser)
    return parser.parse_args()


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def report(name: str, title: str, rows: list[dict[str, Any]], out: Path | None, notes: str = "",
           raw: dict[str, Any] | None = None) -> None:
    """Print rows (dicts with the same keys) as an aligned table and write everything to JSON, with raw (the
    measurements behind the rows, e.g. every run of a repeated way) where given."""
    columns = list(rows[0])
    cells = [[_format(row[column]) for column in columns] for row in rows]
    widths = [max(len(column), *(len(cell[i]) for cell in cells)) for i, column in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(column.rjust(width) for column, width in zip(columns, widths)))
    for cell in cells:
        print("  ".join(value.rjust(width) for value, width in zip(cell, widths)))
    if notes:
        print(notes)
    path = out or Path(__file__).parent / "results" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "title": title, "machine": machine(), "notes": notes,
                                "rows": rows, **({"raw": raw} if raw else {})}, indent=2))
    print(f"wrote {path}")


def _format(value: Any) -> str:
    if isinstance(value, float):
        if 0 < abs(value) < 1e-3:
            return f"{value:.1e}"
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
