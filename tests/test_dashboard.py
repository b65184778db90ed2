"""The /harmony page on a real LocalCluster's dashboard: per-device figures and per-model progress during a run,
the devices' worker metrics in Dask's own worker table, and the page drawn by headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import Client, LocalCluster
from torch import nn

import harmony

ARTIFACTS = Path(__file__).parent / "artifacts"
BUDGET = 1_500_000


class HeldLoader:
    """Batches whose last one is handed out only once released (or after a minute): the run lasts as long as the
    test looks at it, without guessing how long that is."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.released = threading.Event()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for index, batch in enumerate(self.batches):
            if index == len(self.batches) - 1:
                self.released.wait(timeout=60)
            yield batch


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


def look(base: str, client: Client, loader: HeldLoader, seen: dict[str, Any]) -> None:
    """During the run: wait until the page has two samples of both devices and a step of every model, keep what it
    and the scheduler's worker table say, and have Chromium draw the page; then let the run end."""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                data = json.loads(fetch(f"{base}/harmony/data.json"))
            except urllib.error.HTTPError:  # no route before the run registers its page
                time.sleep(0.3)
                continue
            devices = data.get("devices", {})
            if (data.get("run") and len(devices) == 2 and all(len(series) >= 2 for series in devices.values())
                    and len(data["models"]) == 3 and all(s[-1][1] > 0 for s in data["models"].values())):
                seen["data"] = data
                break
            time.sleep(0.3)
        seen["page"] = fetch(f"{base}/harmony").decode()
        seen["metrics"] = client.run_on_scheduler(
            lambda dask_scheduler: {str(ws.name): {k: v for k, v in ws.metrics.items() if k.startswith("harmony_")}
                                    for ws in dask_scheduler.workers.values()})
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is not None:
            ARTIFACTS.mkdir(exist_ok=True)
            shot = ARTIFACTS / "harmony-page.png"
            shot.unlink(missing_ok=True)
            seen["chromium"] = subprocess.run(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--hide-scrollbars", f"--screenshot={shot}",
                 "--window-size=1300,1000", "--virtual-time-budget=4000", f"{base}/harmony"],
                capture_output=True, text=True, timeout=60)
            seen["shot"] = shot
    finally:
        loader.released.set()


def test_the_harmony_page_serves_each_devices_figures_during_a_run_and_chromium_draws_it(no_leaks: None) -> None:
    torch.manual_seed(0)
    loader = HeldLoader([(torch.randn(64, 32), torch.randn(64, 1)) for _ in range(400)])
    models = [nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))
              for _ in range(3)]
    seen: dict[str, Any] = {}
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster) as client,
    ):
        base = cluster.dashboard_link.rsplit("/", 1)[0]
        watcher = threading.Thread(target=look, args=(base, client, loader, seen), daemon=True)
        watcher.start()
        result = harmony.train(models, loader, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.01),
                               cluster=client, device_memory=BUDGET, fuse=False, names=["a", "b", "c"],
                               val_loaders=loader.batches[:2], eval_every=50, progress=False)
        watcher.join(timeout=60)
        after = json.loads(fetch(f"{base}/harmony/data.json"))
    assert result.stats.steps == [400] * 3
    data = seen["data"]
    assert set(data["devices"]) == set(result.stats.peak_device_bytes)
    for series in data["devices"].values():
        _, budget, cached, bytes_in, bytes_out, busy, threads = series[-1]
        assert budget == BUDGET and 0 <= cached <= BUDGET and 0 <= busy <= 1 and threads >= 1
        assert bytes_in > 0 and bytes_out > 0, "swapped models move bytes in and out"
    assert set(data["models"]) == {"a", "b", "c"}
    assert all(isinstance(series[-1][2], float) for series in data["models"].values()), "each model's loss"
    assert "<title>Harmony</title>" in seen["page"]
    for device, metrics in seen["metrics"].items():
        assert metrics["harmony_budget"] == BUDGET and metrics["harmony_in"] > 0, device
    assert after == {"run": None}, "between runs the page says none is going"
    if "shot" not in seen:
        pytest.skip("chromium is not installed (.ci/run installs it): the page was not drawn")
    assert seen["chromium"].returncode == 0, seen["chromium"].stderr[-2000:]
    from matplotlib.image import imread

    pixels = imread(seen["shot"])
    drawn = (pixels[..., :3].mean(axis=2) < 0.9).mean()
    assert drawn > 0.01, f"the screenshot is blank ({drawn:.2%} of its pixels drawn)"


def test_the_driver_publishes_the_runs_latest_events_as_lines() -> None:
    from types import SimpleNamespace

    from harmony.runtime.dashboard import EVENTS, model_snapshot

    joined = [{"at": float(at), "event": "worker joined", "device": "cpu-1"} for at in range(EVENTS + 5)]
    state = SimpleNamespace(model_steps=lambda: (3, 10), events=joined, jobs=[])
    snapshot = model_snapshot("r", SimpleNamespace(latest=lambda: [], state=state), None)
    assert snapshot["events"] == [f"cpu-1's worker joined {at}.0 s into the run" for at in range(5, EVENTS + 5)]


@pytest.mark.parametrize("events", [["cpu-1's worker was lost 3.0 s into the run", "model 2 stopped at step 4 (5.0 "
                                     "s into the run): <lambda> raised ValueError"], []], ids=["events", "none"])
def test_the_page_lists_the_events_it_is_given_as_text(tmp_path: Path, events: list[str]) -> None:
    """The page itself, drawn by Chromium from a file beside a data.json of its own: its events as list items of
    plain text (a model's error may hold markup's characters), or a line saying there are none."""
    from harmony.runtime.dashboard import PAGE

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    (tmp_path / "harmony").mkdir()
    (tmp_path / "harmony" / "data.json").write_text(json.dumps({
        "run": "r", "seconds": 9.0, "steps": 3, "total": 10, "devices": {"cpu-0": [[1.0, 100, 50, 10, 10, 0.5]]},
        "models": {"a": [[1.0, 3, 0.5, None]]}, "events": events}))
    page = tmp_path / "harmony.html"
    page.write_text(PAGE.read_text())
    drawn = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                            "--allow-file-access-from-files", "--virtual-time-budget=3000", "--dump-dom",
                            page.as_uri()], capture_output=True, text=True, timeout=60)
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    listed = drawn.stdout.split('<ul id="events">', 1)[1].split("</ul>", 1)[0]
    expected = [line.replace("<", "&lt;").replace(">", "&gt;") for line in events] or [
        "none: no device worker lost, no model stopped"]
    assert listed == "".join(f"<li>{line}</li>" for line in expected), listed
    assert "run r · 3 / 10 model-steps" in drawn.stdout
