"""A finished run on one page: every model's training and validation curves, a table of its figures, and each
device's timeline (computing, waiting for copies, idle). matplotlib draws it and pandas gives the tables as
DataFrames; both are optional extras (``pip install harmony[report]``)."""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harmony.result import TrainResult


def model_rows(result: TrainResult) -> list[dict[str, Any]]:
    """Per model: its name, steps, final loss, final and best validation loss, samples/s, and why it stopped."""
    rows = []
    for model in range(len(result.models)):
        history = result.history[model]
        validation = result.val_history[model] if result.val_history else []
        finite = [loss for _, loss in validation if math.isfinite(loss)]
        rows.append({
            "model": model,
            "name": result.name(model),
            "steps": result.stats.steps[model],
            "loss": history[-1] if history else None,
            "val_loss": validation[-1][1] if validation else None,
            "best_val_loss": min(finite) if finite else None,
            "samples_per_s": samples_per_second(result, model),
            "stopped": (str(result.failed[model]["reason"]) if model in result.failed else
                        f"pruned at step {result.pruned[model]}" if model in result.pruned else ""),
        })
    return rows


def samples_per_second(result: TrainResult, model: int) -> float | None:
    """The model's samples per second once running (over all of its steps where they are too few to skip any)."""
    samples = result.samples[model] if model < len(result.samples) else 0
    times = result.stats.step_seconds[model] if model < len(result.stats.step_seconds) else []
    if not samples or not times:
        return None
    try:
        return samples / result.stats.steady_seconds_per_step(model)
    except ValueError:
        return samples * len(times) / times[-1] if times[-1] > 0 else None


def device_rows(result: TrainResult) -> list[dict[str, Any]]:
    """Per device: its budget, peak accounted bytes, bytes in and out, and its busy and copy-waiting shares."""
    rows = []
    run = max((end for tasks in result.stats.timeline.values() for _, end, _, _ in tasks), default=0.0)
    for name, peak in result.stats.peak_device_bytes.items():
        tasks = [task for task in result.stats.timeline.get(name, []) if not task[3].startswith("upd-")]
        busy = sum(end - start for start, end, _, _ in tasks)
        waiting = sum(wait for _, _, wait, _ in tasks)
        rows.append({"device": name, "budget": result.stats.budgets.get(name), "peak_bytes": peak,
                     "busy": busy / run if run else None, "waiting_for_copies": waiting / run if run else None,
                     "tasks": len(tasks)})
    return rows


def step_rows(result: TrainResult) -> list[dict[str, Any]]:
    """One row per model and step: its training loss, its gradient norm before clipping where it is clipped, and its
    validation figures where it was evaluated then."""
    rows = []
    for model, history in enumerate(result.history):
        validation = dict(result.val_history[model]) if result.val_history else {}
        metrics = dict(result.val_metrics[model]) if result.val_metrics else {}
        norms = result.grad_norms[model] if result.grad_norms else []
        for index, loss in enumerate(history):
            step = index + 1
            rows.append({"model": model, "name": result.name(model), "step": step, "loss": loss,
                         "grad_norm": norms[index] if index < len(norms) else None,
                         "val_loss": validation.get(step), **metrics.get(step, {})})
    return rows


def to_dataframe(result: TrainResult, kind: str = "models") -> Any:
    """The run's figures as a pandas DataFrame: "models" (one row per model), "steps" (per model and step) or
    "devices" (per device)."""
    try:
        import pandas
    except ImportError:
        raise ImportError("to_dataframe needs pandas: pip install pandas") from None
    tables = {"models": model_rows, "steps": step_rows, "devices": device_rows}
    if kind not in tables:
        raise ValueError(f"kind={kind!r}: use one of {sorted(tables)}")
    return pandas.DataFrame(tables[kind](result))


def figure(result: TrainResult) -> Any:
    """The page as a matplotlib figure: curves, the models' table, the devices' timeline."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib import pyplot
    except ImportError:
        raise ImportError("the report needs matplotlib: pip install matplotlib") from None
    models = model_rows(result)
    devices = sorted(result.stats.timeline) or sorted(result.stats.peak_device_bytes)
    shown = models if len(models) <= 24 else sorted(models, key=_rank)[:24]
    fig = pyplot.figure(figsize=(11, 4 + 0.25 * len(shown) + 0.45 * len(devices) + 3.5), layout="constrained")
    grid = fig.add_gridspec(3, 1, height_ratios=[3.5, 0.6 + 0.25 * len(shown), 0.8 + 0.45 * len(devices)])
    _curves(fig.add_subplot(grid[0]), result)
    _table(fig.add_subplot(grid[1]), shown, len(models))
    _timeline(fig.add_subplot(grid[2]), result, devices)
    return fig


def write_report(result: TrainResult, path: str | Path) -> Path:
    """Write the page: a PNG (path ending in .png), or an HTML page with the PNG in it and the tables as HTML."""
    path = Path(path)
    fig = figure(result)
    from matplotlib import pyplot

    try:
        if path.suffix.lower() == ".html":
            buffer = io.BytesIO()
            fig.savefig(buffer, format="png", dpi=110)
            image = base64.b64encode(buffer.getvalue()).decode()
            page = ["<!doctype html><meta charset='utf-8'><title>Harmony run</title>",
                    "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
                    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style>",
                    f"<h1>Harmony run: {len(result.models)} models</h1>",
                    f"<img alt='curves, models and device timeline' src='data:image/png;base64,{image}'>",
                    "<h2>Models</h2>", _html_table(model_rows(result)),
                    "<h2>Devices</h2>", _html_table(device_rows(result))]
            path.write_text("\n".join(page))
        else:
            fig.savefig(path, dpi=110)
    finally:
        pyplot.close(fig)
    return path


def _rank(row: dict[str, Any]) -> float:
    value = row["val_loss"] if row["val_loss"] is not None else row["loss"]
    return value if value is not None and math.isfinite(value) else math.inf


def _curves(axes: Any, result: TrainResult) -> None:
    for model, history in enumerate(result.history):
        if not history:
            continue
        color = f"C{model % 10}"  # a model's two curves in one color
        axes.plot(range(1, len(history) + 1), history, color=color, alpha=0.55, linewidth=1,
                  label=result.name(model))
        validation = result.val_history[model] if result.val_history else []
        if validation:
            steps, losses = zip(*validation)
            axes.plot(steps, losses, color=color, marker="o", linestyle="--", linewidth=1.5)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (solid: training, dashed: validation)")
    axes.set_title("Training and validation loss")
    positive = [loss for history in result.history for loss in history if math.isfinite(loss)]
    if positive and min(positive) > 0 and max(positive) / min(positive) > 50:
        axes.set_yscale("log")
    if len(result.history) <= 12:
        axes.legend(fontsize=8, ncols=2)
    axes.grid(alpha=0.3)


def _table(axes: Any, rows: list[dict[str, Any]], total: int) -> None:
    axes.axis("off")
    columns = ["name", "steps", "loss", "val_loss", "best_val_loss", "samples_per_s", "stopped"]
    cells = [[_cell(row[column]) for column in columns] for row in rows]
    title = "Models" if len(rows) == total else f"Models (best {len(rows)} of {total})"
    axes.set_title(title, loc="left")
    if cells:
        table = axes.table(cellText=cells, colLabels=columns, loc="upper center", cellLoc="right")
        table.auto_set_font_size(False)
        table.set_fontsize(8)
        table.auto_set_column_width(list(range(len(columns))))


def _timeline(axes: Any, result: TrainResult, devices: list[str]) -> None:
    """Per device a row: computing (blue), waiting for copies (orange), idle (blank), and under it the updates its
    host thread ran beside it (green)."""
    for row, name in enumerate(devices):
        tasks = [task for task in result.stats.timeline.get(name, []) if not task[3].startswith("upd-")]
        updates = [(start, end - start) for start, end, _, key in result.stats.timeline.get(name, [])
                   if key.startswith("upd-")]
        computing = [(start, end - start) for start, end, _, _ in tasks]
        waiting = [(start, min(wait, end - start)) for start, end, wait, _ in tasks if wait > 0]
        axes.broken_barh(computing, (row - 0.35, 0.55), color="#4c72b0")
        axes.broken_barh(waiting, (row - 0.35, 0.55), color="#dd8452")
        axes.broken_barh(updates, (row + 0.22, 0.13), color="#55a868")
    axes.set_yticks(range(len(devices)), devices)
    axes.set_xlabel("seconds since the run started")
    axes.set_title("Devices: computing (blue), waiting for copies (orange, drawn at each task's start), idle; "
                   "host updates beside them (green)", loc="left")
    axes.invert_yaxis()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _html_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(column)}</th>" for column in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(value))}</td>" for value in row.values()) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
