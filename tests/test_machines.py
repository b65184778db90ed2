"""Many machines, for real on one box: each stand-in machine is a group of plain ``dask worker`` processes in a
mount namespace of its own with a private /dev/shm, and the driver runs in yet another, so that nothing can pass
between them through shared memory. The results equal plain PyTorch; each machine's /dev/shm holds files only of
the models homed there, the driver's none; nothing is left after the run."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from distributed import Client
from torch import nn

from tests.conftest import assert_same_weights, deep_mlp, regression_batches, train_plain

STEPS = 6
SHM = "mount -t tmpfs -o size=512m,mode=1777 tmpfs /dev/shm"


def namespaces_work() -> bool:
    try:
        done = subprocess.run(["unshare", "--mount", "sh", "-c", SHM], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


pytestmark = pytest.mark.skipif(not namespaces_work(),
                                reason="needs mount namespaces (unshare --mount, as root) for stand-in machines")


def sgd(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05)  # type: ignore[arg-type]


def sweep() -> tuple[list[nn.Module], list[list]]:
    """Six models: four of one architecture on one loader (fused into arrays of two), two of another on their own."""
    shared = regression_batches(6 * 8, 8, seed=1)
    models = [deep_mlp(depth=4, seed=seed) for seed in range(4)] + [deep_mlp(depth=6, seed=seed) for seed in (4, 5)]
    loaders = [shared] * 4 + [regression_batches(6 * 8, 8, seed=seed) for seed in (2, 3)]
    return models, loaders


DRIVER = """
import sys
import torch
from torch import nn
import harmony
from tests.test_machines import sgd, sweep

models, loaders = sweep()
result = harmony.train(models, loaders, loss_fn=nn.functional.mse_loss, optimizer=sgd, cluster=sys.argv[1],
                       device_memory=100_000, fuse=2, progress=False)
torch.save({"states": [model.state_dict() for model in models],
            "jobs": [(job.machine, job.members) for job in result.plan.jobs],
            "arrays": result.arrays}, sys.argv[2])
"""


def in_namespace(command: str) -> list[str]:
    """command in a mount namespace of its own with a private /dev/shm."""
    return ["unshare", "--mount", "sh", "-c", f"{SHM} && {command}"]


def shm_of(pid: int) -> Path:
    """The /dev/shm that process pid sees."""
    return Path(f"/proc/{pid}/root/dev/shm")


def harmony_files(pid: int) -> set[str]:
    try:
        return {path.name for path in shm_of(pid).glob("harmony-*")}
    except OSError:
        return set()


def environment() -> dict[str, str]:
    """The workers' and driver's: they import this module (as pytest named it) to unpickle its functions."""
    tests = str(Path(__file__).parent)
    paths = [os.getcwd(), tests, os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


@pytest.fixture
def machines(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A dask scheduler on loopback and two stand-in machines of two dask workers each, over TCP, or over UCX
    where a test asks for it (indirect parameter "ucxx") and distributed-ucxx is installed."""
    protocol = getattr(request, "param", "tcp")
    if protocol == "ucxx":
        pytest.importorskip("distributed_ucxx")
    with socket.socket() as probe:  # a port free now (UCX's listener may not take one a TCP scheduler just left)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"{protocol}://127.0.0.1:{port}"
    scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                  "--port", str(port), "--protocol", protocol, "--no-dashboard"], env=environment(),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    groups = []
    for machine in "ab":
        workers = " & ".join(
            f"{sys.executable} -m distributed.cli.dask_worker {address} --nthreads 1 --name {machine}-{index} "
            f"--host 127.0.0.1 --protocol {protocol} --no-dashboard --no-nanny" for index in range(2))
        groups.append(subprocess.Popen(in_namespace(f"{workers} & wait"), env=environment(),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(4, timeout=120)
        yield address, groups
    finally:
        for process in [*groups, scheduler]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)  # a worker whose scheduler went first would retry for a while
            process.wait()


@pytest.mark.parametrize("machines", ["tcp", "ucxx"], indirect=True)
def test_two_machines_train_six_models_each_in_its_own_store_and_equal_plain_pytorch(
    machines: tuple[str, list[subprocess.Popen]], tmp_path: Path
) -> None:
    address, groups = machines
    script, out = tmp_path / "driver.py", tmp_path / "result.pt"
    script.write_text(DRIVER)
    driver = subprocess.Popen(in_namespace(f"exec {sys.executable} {script} {address} {out}"), env=environment(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen: list[set[str]] = [set(), set()]
    driver_seen: set[str] = set()
    deadline = time.monotonic() + 400
    while driver.poll() is None and time.monotonic() < deadline:
        for index, group in enumerate(groups):
            seen[index] |= harmony_files(group.pid)
        driver_seen |= harmony_files(driver.pid)
        time.sleep(0.1)
    if driver.poll() is None:
        os.killpg(driver.pid, 9)
    output = driver.communicate()[0].decode(errors="replace")
    assert driver.returncode == 0, output[-4000:]
    saved = torch.load(out, weights_only=False)

    models, loaders = sweep()
    for index, (model, batches) in enumerate(zip(models, loaders)):
        train_plain(model, batches[:STEPS], nn.functional.mse_loss, sgd)
        trained = deep_mlp(depth=4 if index < 4 else 6)
        trained.load_state_dict(saved["states"][index])
        assert_same_weights(trained, model)

    assert saved["arrays"] == [[0, 1], [2, 3], [4], [5]], "four models of one architecture: two arrays of two"
    identities = {os.stat(shm_of(group.pid)).st_dev: index for index, group in enumerate(groups)}
    homed: list[set[int]] = [set(), set()]
    for job, (machine, _) in enumerate(saved["jobs"]):
        homed[identities[int(machine.rsplit("/", 1)[1])]].add(job)
    assert homed[0] and homed[1], f"both machines train: {saved['jobs']}"
    for index in (0, 1):
        jobs = {name.split("-")[2] for name in seen[index] if name.split("-")[2].startswith("m")}
        assert jobs == {f"m{job}" for job in homed[index]}, f"machine {index} holds files of {jobs}"
    assert not driver_seen, f"the driver's /dev/shm held {sorted(driver_seen)[:5]}"
    time.sleep(1)
    assert not harmony_files(groups[0].pid) and not harmony_files(groups[1].pid), "files left behind"


def test_the_models_of_a_machine_lost_for_good_fail_alone_and_the_others_equal_plain_pytorch(
    machines: tuple[str, list[subprocess.Popen]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machine b's workers all die mid-run (none comes back): after the device timeout its models are in
    result.failed with the reason, and machine a's models train to the end, equal to plain PyTorch."""
    import threading

    import harmony

    monkeypatch.setattr("harmony.runtime.driver.DEVICE_TIMEOUT", 3.0)
    address, groups = machines
    models, loaders = sweep()
    references = [copy.deepcopy(model) for model in models]
    killed = threading.Event()

    def kill_machine_b() -> None:
        while not killed.is_set():
            if any("-m" in name and "weights" in name for name in harmony_files(groups[1].pid)):
                time.sleep(0.5)
                os.killpg(groups[1].pid, 9)
                killed.set()
            time.sleep(0.05)

    killer = threading.Thread(target=kill_machine_b, daemon=True)
    killer.start()
    try:
        result = harmony.train(models, [batches * 20 for batches in loaders], loss_fn=nn.functional.mse_loss,
                               optimizer=sgd, cluster=address, device_memory=100_000, fuse=False, progress=False,
                               steps_per_task=1)
    finally:
        killed.set()
        killer.join()
    machine_of = {model: job.machine for job in result.plan.jobs for model in job.members}
    lost = {model for model in range(6) if machine_of[model] != machine_of[min(set(range(6)) - set(result.failed))]}
    assert lost and set(result.failed) == lost, f"failed {sorted(result.failed)}, machines {machine_of}"
    for model in lost:
        assert "every worker of its machine has been lost for 3 s" in str(result.failed[model]["reason"])
    for index in set(range(6)) - lost:
        train_plain(references[index], (loaders[index] * 20)[: len(loaders[index]) * 20], nn.functional.mse_loss,
                    sgd)
        assert_same_weights(models[index], references[index])
    assert not harmony_files(groups[0].pid)


def stop_one_and_four(step: int, standings: list) -> list[int]:
    """A pruner: model 1 (a member of the array [0, 1]) and model 4 (a job alone) stop at step 2."""
    return [standing.index for standing in standings if step == 2 and standing.index in (1, 4)]


PRUNED_DRIVER = """
import sys
import torch
from torch import nn
import harmony
from tests.conftest import regression_batches
from tests.test_machines import sgd, stop_one_and_four, sweep

models, loaders = sweep()
result = harmony.train(models, loaders, loss_fn=nn.functional.mse_loss, optimizer=sgd, cluster=sys.argv[1],
                       device_memory=100_000, fuse=2, progress=False, val_loaders=regression_batches(16, 8, seed=9),
                       eval_every=2, prune=stop_one_and_four)
torch.save({"states": [model.state_dict() for model in models], "pruned": result.pruned,
            "arrays": result.arrays, "machines": sorted({job.machine for job in result.plan.jobs})}, sys.argv[2])
"""


def test_a_pruned_member_of_an_array_on_another_machine_keeps_its_weights_of_that_step(
    machines: tuple[str, list[subprocess.Popen]], tmp_path: Path
) -> None:
    """The driver's machine has no store: it writes a pruned member's step into the machine's file that the
    workers there map already (in place), and ranks the members from the files it pulls from them."""
    address, _ = machines
    script, out = tmp_path / "driver.py", tmp_path / "result.pt"
    script.write_text(PRUNED_DRIVER)
    done = subprocess.run(in_namespace(f"exec {sys.executable} {script} {address} {out}"), env=environment(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=400, start_new_session=True)
    assert done.returncode == 0, done.stdout.decode(errors="replace")[-4000:]
    saved = torch.load(out, weights_only=False)
    assert saved["arrays"] == [[0, 2], [1, 3], [4], [5]] and len(saved["machines"]) == 2  # dealt out in turn
    assert saved["pruned"] == {1: 2, 4: 2}
    models, loaders = sweep()
    for index, (model, batches) in enumerate(zip(models, loaders)):
        train_plain(model, batches[:saved["pruned"].get(index, STEPS)], nn.functional.mse_loss, sgd)
        trained = deep_mlp(depth=4 if index < 4 else 6)
        trained.load_state_dict(saved["states"][index])
        assert_same_weights(trained, model)
