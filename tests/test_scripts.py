"""harmony.train as users call it: a script with no __main__ guard, a notebook-like session, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import harmony_files, started_by, worker_processes, zygotes

pytestmark = pytest.mark.usefixtures("cold_start")  # every test here runs Harmony in processes of its own

SCRIPT = """
import torch
from torch import nn
import harmony

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x):
        return self.body(x)

torch.manual_seed(0)
x = torch.randn(64, 8)
y = x.sum(dim=1, keepdim=True)
batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
models = [Net() for _ in range(2)]
result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss,
                       optimizer=[lambda p: torch.optim.SGD(p, lr=0.05), lambda p: torch.optim.Adam(p, lr=0.01)],
                       epochs={epochs}, microbatches=2, devices=["cpu", "cpu"], progress=False)
print("TRAINED", [len(h) for h in result.history])
"""


def run_python(args: list[str], source: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], input=source if args == ["-"] else None, text=True, capture_output=True,
        cwd=cwd, timeout=180, env={**os.environ, "PYTHONPATH": path},
    )


def test_a_script_without_a_main_guard(tmp_path: Path, no_leaks: None) -> None:
    script = tmp_path / "train_sweep.py"
    script.write_text(SCRIPT.format(epochs=2))
    done = run_python([str(script)], "", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("TRAINED") == 1, "the script ran more than once: a worker re-imported __main__"
    assert "TRAINED [8, 8]" in done.stdout


CUSTOM_OPERATOR = """
import copy
import torch
from torch import nn
import harmony

@torch.library.custom_op("user_script::leaky", mutates_args=())
def leaky(x: torch.Tensor, slope: float) -> torch.Tensor:
    return torch.where(x > 0, x, x * slope)

@leaky.register_fake
def _(x, slope):
    return torch.empty_like(x)

def setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.slope = inputs[1]

def backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.where(x > 0, grad, grad * ctx.slope), None

leaky.register_autograd(backward, setup_context=setup)

def loss(output, target):  # the operator in the loss too: it travels with the loss function
    return nn.functional.mse_loss(leaky(output, 1.0), target)

class Leaky(nn.Module):
    def forward(self, x):
        return torch.ops.user_script.leaky(x, 0.1)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), Leaky(), nn.Linear(32, 32), Leaky(), nn.Linear(32, 32), Leaky(),
                      nn.Linear(32, 1)).double()
plain = copy.deepcopy(model)
x = torch.randn(64, 8, dtype=torch.float64)
batches = [(x[i:i + 16], x[i:i + 16].sum(dim=1, keepdim=True)) for i in range(0, 64, 16)]
def positive(output, target):  # and in a metric
    return (leaky(output, 0.0) > 0).double().mean()

result = harmony.train(model, batches, loss_fn=loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
                       microbatches=2, devices=["cpu", "cpu"], device_memory=45_000, resident=False, progress=False,
                       val_loaders=batches[:1], eval_every=2, metrics=positive)
optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
for inputs, targets in batches:
    optimizer.zero_grad()
    loss(plain(inputs), targets).backward()
    optimizer.step()
packs = len(result.packings[0].packs)
difference = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
measured = result.val_metrics[0][-1][1]["positive"]
expected = (plain(batches[0][0]) > 0).double().mean().item()
print("TRAINED", packs, difference, measured, expected)
"""


def test_a_custom_operator_defined_in_the_script_trains_in_packs_on_the_workers(tmp_path: Path,
                                                                                no_leaks: None) -> None:
    """A torch.library custom operator the user's script defines (its __main__, which workers cannot import), with
    its fake and autograd rules, runs on the workers, in the model, the loss function and a metric: the model trains in
    packs on two devices to plain PyTorch's weights (float64). Before, none of them pickled."""
    script = tmp_path / "custom_operator.py"
    script.write_text(CUSTOM_OPERATOR)
    done = run_python([str(script)], "", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    packs, difference, measured, expected = done.stdout.split("TRAINED")[1].split()
    assert int(packs) >= 3 and float(difference) < 1e-12, done.stdout
    assert measured == expected, "the metric, on the workers, as plain PyTorch's weights give it"


def test_code_from_an_interactive_session(tmp_path: Path, no_leaks: None) -> None:
    done = run_python(["-"], SCRIPT.format(epochs=1), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "TRAINED [4, 4]" in done.stdout


def ctrl_c_as_at_a_terminal() -> None:
    """In the script's process before it starts: SIGINT's default action, which Python replaces with its
    KeyboardInterrupt. A suite run in the background of a shell without job control (``pytest &``) inherits SIGINT
    ignored, and Python leaves an ignored SIGINT ignored: the script would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_leaves_no_workers_and_no_shared_memory(tmp_path: Path) -> None:
    script = tmp_path / "long_sweep.py"
    script.write_text(SCRIPT.format(epochs=100_000))
    before = set(harmony_files())
    process = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))},
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    try:
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        while time.monotonic() < deadline:
            children = started_by(process.pid, worker_processes())
            if len(children) == 2 and set(harmony_files()) - before:
                break
            time.sleep(0.2)
        assert len(children) == 2, "the workers never started"
        children += started_by(process.pid, zygotes())  # what they were forked from
        time.sleep(2.0)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert not set(harmony_files()) - before
    psutil.wait_procs(children, timeout=10)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


HANDLED = SCRIPT.replace("import harmony", """import harmony, signal, sys

def stop(signum, frame):
    print("STOPPED BY THE USER'S HANDLER", flush=True)
    sys.exit(3)

signal.signal(signal.SIGINT, stop)""")


def test_ctrl_c_to_the_whole_process_group_with_the_users_own_handler_stops_cleanly(tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to its foreground process group; the embedded workers are outside it, so the
    driver alone hears it (here through the user's handler) and shuts them down."""
    script = tmp_path / "handled.py"
    script.write_text(HANDLED.format(epochs=100_000))
    before = set(harmony_files())
    process = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        while time.monotonic() < deadline:
            children = started_by(process.pid, worker_processes())
            if len(children) == 2 and set(harmony_files()) - before:
                break
            time.sleep(0.2)
        assert len(children) == 2, "the workers never started"
        children += started_by(process.pid, zygotes())  # what they were forked from
        time.sleep(2.0)
        os.killpg(process.pid, signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 3, stderr
    assert "STOPPED BY THE USER'S HANDLER" in stdout
    assert not set(harmony_files()) - before
    psutil.wait_procs(children, timeout=10)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_the_gpt_sweep_example_runs_and_picks_the_best_configuration(no_leaks: None) -> None:
    """examples/gpt_sweep.py --smoke: a grid of GPT-style models on the standard library's source, under a budget
    below the largest model, cut into packs; it prints every configuration's validation loss and the best, and
    nothing of the pilot's probes (a layer tried on half its samples, a trial array)."""
    example = Path(__file__).parent.parent / "examples" / "gpt_sweep.py"
    done = subprocess.run([sys.executable, str(example), "--smoke"], text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "raised" not in done.stdout + done.stderr, (
        "no probe's error on the terminal, and arrays of its models build", done.stderr[-3000:])
    rows = [line.split() for line in done.stdout.splitlines() if line[:6].strip().isdigit()]
    assert len(rows) == 4 and all(int(row[3]) > 1 for row in rows if row[0] == "64"), done.stdout
    losses = {float(row[6]) for row in rows}
    assert f"validation loss {min(losses):.3f}" in done.stdout.splitlines()[-1]


@pytest.mark.parametrize("prune", [False, True], ids=["grid", "pruned"])
def test_the_quickstart_trains_the_grid_evaluates_it_and_writes_its_report(
    prune: bool, tmp_path: Path, no_leaks: None
) -> None:
    """examples/quickstart.py --report: six models in two groups that may fuse (one per optimizer class) under a
    300 kB budget, evaluated on held-out points; it prints every model's validation loss and accuracy, the best, and
    each group's fusion choice by its optimizer, and writes the report page. With
    --prune, the models stop by successive halving at steps 16, 32 and 48: three, one and one of them."""
    example = Path(__file__).parent.parent / "examples" / "quickstart.py"
    page = tmp_path / "run.png"
    done = subprocess.run([sys.executable, str(example), "--report", str(page), *(["--prune"] if prune else [])],
                          text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("SGD", "Adam"))]
    assert len(rows) == 6, done.stdout
    steps = sorted(int(row[22:].split()[2]) for row in rows)
    assert steps == ([16, 16, 16, 32, 48, 64] if prune else [64] * 6), done.stdout
    best = min(rows, key=lambda row: float(row.split()[-2]))
    assert f"best: {best[:22].strip()} (validation loss {float(best.split()[-2]):.4f}" in done.stdout, done.stdout
    assert all(f"3 x MLP ({group})" in done.stdout for group in ("SGD+momentum", "Adam")), done.stdout
    assert page.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
