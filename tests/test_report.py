"""The report page (PNG and HTML) and the DataFrames of a finished run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import harmony
from tests.conftest import deep_mlp, regression_batches


@pytest.fixture(scope="module")
def result() -> harmony.TrainResult:
    models = [deep_mlp(depth=2, seed=seed) for seed in range(3)]
    batches = regression_batches(samples=8 * 6, batch=8)
    return harmony.train(models, batches, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.05), devices=2,
                         val_loaders=batches[:2], eval_every=3, names=["a", "b", "c"],
                         clip_grad_norm=[0.01, None, None], progress=False)


def test_the_report_is_a_png_or_an_html_page_with_the_tables(result: harmony.TrainResult, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = result.report(tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    page = result.report(tmp_path / "run.html").read_text()
    assert "data:image/png;base64," in page and page.count("<tr>") == 1 + 3 + 1 + 2  # heads, models, devices
    for name in ("a", "b", "c", "cpu-0", "cpu-1"):
        assert f"<td>{name}</td>" in page


def test_the_dataframes_hold_the_results_figures(result: harmony.TrainResult) -> None:
    pytest.importorskip("pandas")
    models = result.to_dataframe()
    assert list(models["name"]) == ["a", "b", "c"] and list(models["steps"]) == [6, 6, 6]
    assert list(models["loss"]) == [history[-1] for history in result.history]
    assert list(models["val_loss"]) == [history[-1][1] for history in result.val_history]
    assert (models["samples_per_s"] > 0).all()
    steps = result.to_dataframe("steps")
    assert len(steps) == 18 and steps["val_loss"].notna().sum() == 6
    assert list(steps[steps["name"] == "a"]["grad_norm"]) == result.grad_norms[0] and len(result.grad_norms[0]) == 6
    assert steps[steps["name"] != "a"]["grad_norm"].isna().all(), "b and c are not clipped"
    devices = result.to_dataframe("devices")
    assert set(devices["device"]) == {"cpu-0", "cpu-1"} and devices["tasks"].sum() > 0
    assert ((devices["busy"] >= 0) & (devices["busy"] <= 1)).all() and (devices["busy"] > 0).any()
    assert (devices["peak_bytes"] <= devices["budget"]).all()
    with pytest.raises(ValueError, match="kind="):
        result.to_dataframe("other")


def test_the_timeline_holds_every_task_each_device_ran(result: harmony.TrainResult) -> None:
    for device, tasks in result.stats.timeline.items():
        assert [key for *_, key in tasks] == result.stats.schedule[device]
        assert all(0 <= start <= end and 0 <= wait <= end - start + 1e-3 for start, end, wait, _ in tasks)
