"""A CPU device's choice between one thread and all of its share, from its own tasks timed both ways."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony
from harmony.runtime.devices import cpu_count
from harmony.runtime.threads import AGREEING, PAIRS, SKIP, Threads
from tests.conftest import (
    ThreadsSeen,
    assert_same_weights,
    deep_mlp,
    one_left_alone,
    param_bytes,
    regression_batches,
    torch_threads,
)


def run(choice: Threads, seconds: dict[int, float], steps: int, packs: int = 4, share: int = 2) -> list[int]:
    """Steps of a job's fwd tasks, one per pack, each taking seconds[threads] of the device; the threads each ran
    with, in order."""
    used = []
    for _ in range(steps):
        for pack in range(packs):
            key = ("fwd", 0, pack)
            threads = choice.threads_for(key, share)
            used.append(threads)
            choice.finished(key, threads, share, seconds[threads])
            choice.validate_state()
    return used


@pytest.mark.parametrize(("single", "every", "one"), [(1.0, 2.0, True), (2.0, 1.0, False)])
def test_a_device_times_its_tasks_both_ways_and_keeps_the_faster(single: float, every: float, one: bool) -> None:
    """Four tasks a step: after the first step (left out), a step with one thread and one with all give four
    ratios, all on one side of one here, so the device keeps the faster way for every task after."""
    choice = Threads()
    used = run(choice, {1: single, 2: every}, steps=12)
    assert used[:4] == [2] * 4 and used[4:8] == [1] * 4 and used[8:12] == [2] * 4, "a task's occurrences alternate"
    assert choice.one is one and len(choice.ratios) == AGREEING == 4
    timed = SKIP + 2
    assert used[4 * timed:] == [1 if one else 2] * (len(used) - 4 * timed), "then kept"


def test_ratios_on_both_sides_of_one_are_timed_to_pairs_enough() -> None:
    choice = Threads()
    key = ("fwd", 0, 0)
    choice.finished(key, choice.threads_for(key, 2), 2, 1.0)  # the first occurrence, left out
    for index in range(PAIRS):
        assert choice.one is None, f"{index} ratios, some each side"
        choice.finished(key, choice.threads_for(key, 2), 2, 0.5 if index % 3 else 1.5)
        choice.finished(key, choice.threads_for(key, 2), 2, 1.0)
        choice.validate_state()
    assert len(choice.ratios) == PAIRS and choice.one is True, "the median: one thread's half the time"


def test_the_median_ratio_decides_and_a_device_of_one_thread_has_nothing_to_choose() -> None:
    choice = Threads(pairs=3)
    key = ("bwd", 1, 0)
    assert choice.threads_for(key, 2) == 2
    assert choice.finished(key, 2, 2, 100.0) is None and not choice.last, "the first occurrence, left out"
    for ratio in (0.5, 1.5, 0.9):
        assert choice.threads_for(key, 2) == 1
        choice.finished(key, 1, 2, ratio)
        assert choice.threads_for(key, 2) == 2
        made = choice.finished(key, 2, 2, 1.0)
    assert choice.ratios == [0.5, 1.5, 0.9] and choice.one is True and made is True, "the median, 0.9"
    assert choice.finished(key, 2, 4, 1.0) is None and choice.one is True, "a task of the old share, not timed"
    assert choice.threads_for(key, 4) == 4 and choice.one is None and not choice.ratios, (
        "a new share (an idle device's threads given) times afresh, all threads first")
    alone = Threads()
    assert run(alone, {1: 1.0, 2: 5.0}, steps=20, share=1) == [1] * 80 and alone.one is None and not alone.ratios


def test_a_cpu_device_of_two_threads_chooses_and_trains_as_plain_pytorch_would() -> None:
    """One CPU device of the machine's threads, swapped packs a task each: it reports its choice, and the float64
    weights are plain PyTorch's (micro-batched the same way) to float64 rounding."""
    if cpu_count() < 2:
        pytest.skip("one CPU thread: nothing to choose")
    batches = [(x.double(), y.double()) for x, y in regression_batches(16 * 24, 16)]
    model = deep_mlp().double()
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.01), devices=["cpu"],
                           device_memory=param_bytes(model) // 3, microbatches=2, packs_per_task=1, progress=False)
    assert result.plan.jobs[0].home is None and set(result.stats.one_thread) == {"cpu-0"}, "timed both ways, chose"
    plain = deep_mlp().double()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.01)
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (nn.functional.mse_loss(plain(xs), ys) / 2).backward()
        optimizer.step()
    assert_same_weights(result.models[0], plain, rtol=1e-12, atol=1e-14)


def test_a_homed_jobs_tasks_of_several_steps_are_not_timed() -> None:
    """Few and long: they run with every thread of the device, and a device that runs nothing else chooses
    nothing."""
    if cpu_count() < 2:
        pytest.skip("one CPU thread: nothing to choose")
    result = harmony.train(deep_mlp(), regression_batches(16 * 80, 16), loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.01), devices=["cpu"], steps_per_task=2,
                           progress=False)
    assert result.plan.jobs[0].home == "cpu-0" and result.stats.steps_per_task == [2], "40 tasks: pairs enough"
    assert result.stats.one_thread == {}


def conv_net() -> nn.Sequential:
    """Convolutions and batch norm, whose sums torch splits by threads: their last bits tell thread counts apart."""
    torch.manual_seed(0)
    return nn.Sequential(ThreadsSeen(), nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 16 * 16, 10))


def test_a_count_of_threads_trains_as_plain_pytorch_at_that_count_bit_for_bit(no_leaks: None) -> None:
    """threads=n: one CPU device of the machine's threads, swapped packs a task each (where threads="auto" times one
    thread against all, and trains with a mix), computes every task with n threads, and its weights and batch norm
    statistics are those of a plain loop at torch.set_num_threads(n), bit for bit."""
    share = cpu_count()
    if share < 2:
        pytest.skip("one CPU thread: a count changes nothing")
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 3, 16, 16, generator=generator), torch.randint(0, 10, (32,), generator=generator))
               for _ in range(12)]
    factory = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    model = conv_net()
    result = harmony.train(model, batches, nn.functional.cross_entropy, factory, devices=["cpu"],
                           device_memory=param_bytes(model) // 2 + 2_400_000, packs_per_task=1, threads=share,
                           progress=False)
    assert result.plan.jobs[0].home is None and len(result.plan.jobs[0].packing.packs) > 1
    assert result.stats.one_thread == {}, "nothing timed, nothing chosen"
    plain = conv_net()
    optimizer = factory(plain.parameters())
    with torch_threads(share):
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.cross_entropy(plain(x), y).backward()
            optimizer.step()
    assert float(model[0].fewest) == float(model[0].most) == share
    assert_same_weights(model, plain, rtol=0, atol=0)


def test_a_count_of_threads_is_each_devices_even_when_another_has_nothing_left(no_leaks: None) -> None:
    """threads=1 on two CPU devices: the model homed on the device that still computes after the other's model ended
    keeps one thread (threads="auto" gives it the idle device's, test_devices); the weights are plain PyTorch's."""
    models = one_left_alone(threads=1)
    assert [(float(model[0].fewest), float(model[0].most)) for model in models] == [(1, 1), (1, 1)]
