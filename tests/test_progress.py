"""The progress line: steps and tasks as they go, and a line of its own for each model that stops."""

from __future__ import annotations

import re

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
    last = shown.rstrip("\n").split("\r")[-1]
    done = int(re.search(r"\| (\d+)/\1 \[", last).group(1))  # the stopped model's steps end where it stopped
    assert 24 < done < 36, last
    assert re.search(rf"harmony: 100%\|.*\| {done}/{done} \[\d\d:\d\d<\d\d:\d\d, +[\d.]+ model-steps/s, "
                     r"3 models, \d+ tasks, 1 stopped\]", last), last


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
