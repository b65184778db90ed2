"""The progress line: steps and tasks as they go, and a line of its own for each model that stops."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
from torch import nn

import harmony
from tests.conftest import deep_mlp, regression_batches


def test_the_line_counts_every_model_and_says_which_stopped_and_when(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without tqdm: one line rewritten in place."""
    from harmony.progress import ProgressLine

    monkeypatch.setattr("harmony.api.display", ProgressLine)
    rates = [0.05, 1e20, 0.02, 1e20]  # in float64 these grow steadily until their loss overflows
    factories = [lambda p, lr=lr: torch.optim.SGD(p, lr=lr) for lr in rates]
    models = [deep_mlp(depth=2, seed=s).double() for s in range(4)]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 12, batch=16)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, devices=["cpu"],
                           fuse=True, progress=True)
    assert sorted(map(len, result.arrays)) == [4] and set(result.failed) == {1, 3}
    shown = capsys.readouterr().err
    for model in (1, 3):
        step = result.failed[model]["step"]
        assert len(re.findall(rf"harmony: model {model} stopped at step {step}: its loss", shown)) == 1
    last = shown.rstrip("\n").split("\r")[-1]
    assert last.startswith("harmony: 4 models, steps ") and ", 2 stopped, " in last, last
    done, total = map(int, re.search(r"steps (\d+)/(\d+)", last).groups())
    assert total == done == 4 * 12  # model-steps: an array's step is a step of each of its members


def test_the_bar_counts_model_steps_with_rate_and_time_left_and_says_which_stopped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("tqdm")
    rates = [0.05, 1e20, 0.02]
    factories = [lambda p, lr=lr: torch.optim.SGD(p, lr=lr) for lr in rates]
    models = [deep_mlp(depth=2, seed=s).double() for s in range(3)]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 12, batch=16)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, devices=["cpu"],
                           fuse=False, progress=True)
    assert set(result.failed) == {1}
    shown = capsys.readouterr().err
    step = result.failed[1]["step"]
    assert len(re.findall(rf"harmony: model 1 stopped at step {step}: .*its loss became inf", shown)) == 1
    done = int(re.findall(r"\| (\d+)/\1 \[", shown)[-1])  # the stopped model's steps end where it stopped
    assert 24 < done < 36, shown
    assert re.search(rf"harmony: 100%\|.*\| {done}/{done} \[\d\d:\d\d<\d\d:\d\d, +[\d.]+ model-steps/s, "
                     r"3 models, \d+ tasks, devices \d+% busy, 1 stopped\]", shown), shown


def test_progress_is_on_in_a_terminal_or_a_notebook_and_off_when_asked_or_when_neither(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from harmony.progress import wants_progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert not wants_progress(None) and wants_progress(True)
    monkeypatch.setitem(sys.modules, "ipykernel", object())
    assert wants_progress(None) and not wants_progress(False)
    monkeypatch.delitem(sys.modules, "ipykernel")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert wants_progress(None)


SCRIPT = """
import torch
from torch import nn
import harmony
torch.manual_seed(0)
batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(40)]
models = [nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)) for _ in range(3)]
harmony.train(models, batches, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.01), devices=1,
              val_loaders=batches[:2], eval_every=10, names=["alpha", "beta", "gamma"])
"""


@pytest.mark.usefixtures("cold_start")
def test_under_a_terminal_the_display_shows_each_models_losses_and_the_time_left(tmp_path: Path) -> None:
    """Run as a user would in a terminal (a pseudo-terminal); with stderr a pipe, nothing is shown."""
    pytest.importorskip("tqdm")
    script = tmp_path / "sweep.py"
    script.write_text(SCRIPT)
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal's size
    process = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=secondary,
                               stderr=secondary, cwd=Path(__file__).parents[1])
    os.close(secondary)
    shown = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        shown += chunk
    os.close(primary)
    assert process.wait(timeout=120) == 0, shown.decode(errors="replace")
    text = shown.decode(errors="replace")
    assert re.search(r"harmony: +\d+%\|.*\| \d+/120 \[\d\d:\d\d<\d\d:\d\d", text), text  # steps, time left
    assert re.search(r"harmony: dashboard at http://127\.0\.0\.1:\d+/status \(Harmony's page: "
                     r"http://127\.0\.0\.1:\d+/harmony\)", text), text
    for name in ("alpha", "beta", "gamma"):
        assert re.search(rf"{name}: step 40, loss [\d.e-]+, val [\d.e-]+ \(step 40\)", text), text
    quiet = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parents[1])
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == "", quiet.stderr

