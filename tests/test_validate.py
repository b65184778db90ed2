"""Bad input gets a clear error naming the model and argument, raised before any worker starts."""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import harmony
from harmony import InputError
from tests.conftest import BatchBranch, deep_mlp, regression_batches


@pytest.fixture(autouse=True)
def no_cluster_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Every test here must fail in seconds, never waiting for workers: an error in the arguments before the
    embedded cluster starts, one that the pilot pass finds (a budget) while it starts in the background (here a
    stand-in that records the start)."""
    starts: list[object] = []
    started_cluster = SimpleNamespace(client=SimpleNamespace(run=lambda *args, **kwargs: {}))
    monkeypatch.setattr("harmony.api.embedded", lambda *args, **kwargs: starts.append(args) or started_cluster)
    started = time.perf_counter()
    yield starts
    assert time.perf_counter() - started < 10


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def call(**overrides: object) -> None:
    arguments: dict[str, object] = {
        "models": [deep_mlp(depth=2), deep_mlp(depth=2)],
        "loaders": regression_batches(samples=32, batch=8),
        "loss_fn": nn.functional.mse_loss,
        "optimizer": sgd,
        "progress": False,
    }
    arguments.update(overrides)
    harmony.train(**arguments)


def test_no_models() -> None:
    with pytest.raises(InputError, match="models is empty"):
        call(models=[])


def test_a_model_that_is_not_a_module() -> None:
    with pytest.raises(InputError, match=r"models\[1\] is a str, not a torch.nn.Module"):
        call(models=[deep_mlp(depth=2), "resnet"])


def test_wrong_number_of_loaders() -> None:
    batches = regression_batches(samples=32, batch=8)
    with pytest.raises(InputError, match="got 3 loaders for 2 models"):
        call(loaders=[batches, batches, batches])


def test_a_loader_that_yields_tensors_not_pairs() -> None:
    tensors = [torch.randn(8, 32) for _ in range(4)]
    with pytest.raises(InputError, match=r"loaders\[1\] \(for model 1\) yields a Tensor.*\(inputs, targets\) pair"):
        call(loaders=[regression_batches(samples=32, batch=8), tensors])


def test_a_loader_that_yields_triples() -> None:
    triples = [(torch.randn(8, 32), torch.randn(8, 4), torch.zeros(8)) for _ in range(2)]
    with pytest.raises(InputError, match="tuple of length 3"):
        call(loaders=triples)


def test_microbatches_larger_than_a_batch() -> None:
    with pytest.raises(InputError, match=r"microbatches=16 is larger than the first batch of model 0 .* \(8 samples\)"):
        call(microbatches=16)


def test_budget_smaller_than_the_largest_layer_needs() -> None:
    with pytest.raises(InputError) as raised:
        call(device_memory="10kB")
    message = str(raised.value)
    assert "device_memory is too small for model 0 (Sequential)" in message
    assert "Linear(in_features=32, out_features=32" in message
    assert "Raise device_memory to at least" in message
    needed = int(message.split("at least ")[1].split(" bytes")[0].replace(",", ""))
    assert needed > 10_000
    assert isinstance(raised.value, harmony.BudgetTooSmall)
    assert raised.value.minimum == needed and raised.value.prefetching > needed
    assert f"({raised.value.prefetching:,} to prefetch)" in message


def test_an_optimizer_instance_instead_of_a_factory() -> None:
    model = deep_mlp(depth=2)
    with pytest.raises(InputError, match=r"optimizer for model 0 .* is an optimizer instance \(Adam\).*factory"):
        call(models=[model], optimizer=torch.optim.Adam(model.parameters()))


def test_an_optimizer_that_is_not_callable() -> None:
    with pytest.raises(InputError, match=r"optimizer for model 1 .* is a float, not a factory"):
        call(optimizer=[sgd, 0.1])


def test_an_optimizer_factory_that_ignores_the_parameters_it_is_given() -> None:
    """A factory over the user's own module would step those tensors, not the copies Harmony trains."""
    model = deep_mlp(depth=2)
    with pytest.raises(InputError, match=r"optimizer factory for model 0 .* over other parameters"):
        call(models=[model], optimizer=lambda params: torch.optim.SGD(model.parameters(), lr=0.1))
    harmony.plan(model, regression_batches(samples=32, batch=8), nn.functional.mse_loss,
                 lambda params: torch.optim.SGD([{"params": params}], lr=0.1), devices=["cpu"])


def test_unknown_device_strings() -> None:
    with pytest.raises(InputError, match=r"devices\[1\] = 'tpu:0' is not a device Harmony knows"):
        call(devices=["cpu", "tpu:0"])


def test_cuda_devices_on_a_machine_without_them() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(InputError, match="this machine has 0 CUDA GPUs"):
        call(devices=["cuda:0"])


def test_a_prefetch_setting_that_is_not_one() -> None:
    with pytest.raises(InputError, match=r"prefetch='activations' is not a prefetch setting; use True .* 'weights'"):
        call(prefetch="activations")


def test_a_size_that_cannot_be_read() -> None:
    with pytest.raises(InputError, match="device_memory='lots' is not a size"):
        call(device_memory="lots")


def test_a_loss_that_is_not_a_scalar() -> None:
    with pytest.raises(InputError, match=r"loss_fn for model 0 .* of shape \(8, 4\)"):
        call(loss_fn=lambda output, target: (output - target) ** 2, microbatches=1)


def test_a_forward_that_fails_in_the_pilot_pass_names_the_model() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("shape mismatch in my layer")

    with pytest.raises(harmony.ModelError, match="model 1 \\(Broken\\) raised RuntimeError: shape mismatch"):
        call(models=[deep_mlp(depth=2), Broken()])


def test_a_model_exported_for_its_batchs_size_is_refused_a_loader_that_gives_it_another_before_work_starts() -> None:
    """BatchBranch does not fit the budget whole: it is exported, its batch's size fixed at its first micro-batch's
    (runtime.stages.Shapes). A loader that says it gives another size (a DataLoader's short last batch, a list of
    batches of two sizes, a batch that microbatches splits unevenly) and validation batches of another size are
    refused, naming the model and the fix."""
    x, y = torch.randn(20, 32), torch.randn(20, 4)
    short = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    for loader, size, extra, said in [
        (short, 8, {}, "micro-batches of 8 samples but not 4 (its loader gives batches of 4)"),
        (regression_batches(16, 8) + regression_batches(6, 6), 8, {},
         "micro-batches of 8 samples but not 6 (its loader gives batches of 6)"),
        (regression_batches(16, 8), 3, {"microbatches": 3},
         "micro-batches of 3 samples but not 2 (its loader gives batches of 8)"),
        (regression_batches(16, 8), 8, {"val_loaders": regression_batches(12, 6)},
         "micro-batches of 8 samples but not 6 (its val_loaders give batches of 6)"),
    ]:
        with pytest.raises(InputError, match=re.escape(f"model 0 (BatchBranch) does not fit the device whole, and "
                                                       f"torch.export's graph of it, cut into packs, holds for {said}"
                                                       )) as raised:
            call(models=[BatchBranch(size=size)], loaders=loader, device_memory=20_000, devices=1, **extra)
        assert "drop_last=True" in str(raised.value)


def test_a_one_shot_iterator_with_several_epochs() -> None:
    with pytest.raises(InputError, match="iterator that can be read only once"):
        call(loaders=iter(regression_batches(samples=32, batch=8)), epochs=2)


def test_an_unknown_cluster_argument() -> None:
    with pytest.raises(InputError, match="cluster=42 must be None"):
        call(cluster=42)


@pytest.mark.parametrize("fuse", ["yes", 0, -2, 1.5])
def test_an_unknown_fusion_setting(fuse: object) -> None:
    with pytest.raises(InputError, match=r"fuse=.* is not a fusion setting; use 'auto'"):
        call(fuse=fuse)


@pytest.mark.parametrize("steps", [0, "many", True])
def test_an_unknown_steps_per_task(steps: object) -> None:
    with pytest.raises(InputError, match=r"steps_per_task=.* must be 'auto'"):
        call(steps_per_task=steps)


@pytest.mark.parametrize("compile", ["yes", 1, None])
def test_a_compile_setting_that_is_not_a_bool(compile: object) -> None:
    with pytest.raises(InputError, match=r"compile=.* must be True or False"):
        call(compile=compile)


@pytest.mark.parametrize("threads", [0, "all", True, 1.5, None])
def test_threads_that_are_not_a_count_or_auto(threads: object, no_cluster_is_waited_for: list[object]) -> None:
    with pytest.raises(InputError, match=r"threads=.* must be 'auto' .* or a count of threads for every device"):
        call(threads=threads)
    assert not no_cluster_is_waited_for, "checked before the cluster starts"


def test_a_model_on_the_meta_device_or_with_nothing_to_train_is_refused_before_any_worker_starts(
    no_cluster_is_waited_for: list[object],
) -> None:
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    batches = regression_batches(samples=16, batch=8)
    with torch.device("meta"):
        meta = deep_mlp(depth=2)
    with pytest.raises(InputError, match=r"model 0 \(Sequential\) has parameters on the meta device \(0.weight"):
        harmony.train(meta, batches, nn.functional.mse_loss, sgd, progress=False)
    frozen = deep_mlp(depth=2).requires_grad_(False)
    with pytest.raises(InputError, match=r"model 1 .* has no trainable parameters"):
        harmony.train([deep_mlp(depth=2), frozen], batches, nn.functional.mse_loss, sgd, progress=False)
    assert not no_cluster_is_waited_for, "the arguments are checked before the cluster starts"


def test_a_list_of_dict_batches_is_one_loader_of_keyword_batches() -> None:
    from harmony.validate import _loaders

    batches = [{"x": torch.randn(4, 3), "labels": torch.randn(4)} for _ in range(3)]
    [loader], owners = _loaders(batches, 2, passes=True)
    assert owners == [0, 0] and loader.keywords and loader.source is batches
    assert [targets for _, targets in loader.loader] == [None] * 3
    per_model, owners = _loaders([batches, batches[:2]], 2, passes=True)
    assert owners == [0, 1] and len(per_model) == 2


class Scheduler(torch.optim.lr_scheduler.LRScheduler):
    pass


@pytest.mark.parametrize(("lr_schedule", "message"), [
    (0.5, "for model 0 .* is a float; lr_schedule must be a callable"),
    (torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), lambda s: 1.0),
     r"is a scheduler \(LambdaLR\)"),
    (Scheduler, r"is a scheduler \(Scheduler\)"),
    (lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), "failed at step 0"),
    (lambda step: "warm", "gave 'warm' at step 0"),
    (lambda step: float("nan"), "gave nan at step 0"),
    (lambda step: -1.0, "gave -1.0 at step 0"),
    (functools.partial(lambda lock, step: 1.0, threading.Lock()), "cannot be pickled"),
    ([lambda step: 1.0], "got 1 entries in lr_schedule for 2 models"),
    (lambda step: 1.0 if step < 3 else float("nan"), "for model 0 .* gave nan at step 3, not a finite factor"),
    (lambda step: [1.0, 0.5][step], r"for model 0 .* failed at step 2 \(IndexError"),
])
def test_a_learning_rate_schedule_that_is_not_a_factor_of_the_step(lr_schedule: object, message: str) -> None:
    """lr_schedule is LambdaLR's lr_lambda, one or one per model: a scheduler (or a factory of one), one that is not
    a finite factor >= 0 at some step of the run (here 4 steps), or one that cannot cross to the workers is refused,
    naming the model (and the step)."""
    with pytest.raises(InputError, match=message):
        call(lr_schedule=lr_schedule)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"clip_grad_norm": 0.0}, "clip_grad_norm for model 0 .* is 0.0; it must be the largest total gradient norm"),
    ({"clip_grad_norm": [1.0, float("inf")]}, "for model 1 .* is inf"),
    ({"clip_grad_norm": "1.0"}, "is '1.0'"),
    ({"clip_grad_norm": True}, "is True"),
    ({"clip_grad_norm": [1.0]}, "got 1 entries in clip_grad_norm for 2 models"),
    ({"clip_grad_norm": 1.0, "overlap_update": False}, "clip_grad_norm steps .* leave overlap_update as None"),
    ({"clip_grad_norm": [None, 1.0], "update_on": "device"}, "clip_grad_norm decides every update"),
])
def test_a_clip_that_is_not_a_largest_norm_or_cannot_see_the_whole_step(overrides: dict, message: str) -> None:
    """clip_grad_norm is clip_grad_norm_'s max_norm, one or one per model (None: not clipped); it decides each
    update from the whole step's gradients, so it is refused beside options that update a pack alone."""
    with pytest.raises(InputError, match=message):
        call(**overrides)
