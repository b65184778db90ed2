"""A job while the run's plan is decided, and the first batch it is planned and piloted on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from harmony.runtime.code import JobCode
from harmony.runtime.data import batch_size, split_tree
from harmony.tasks.microbatch import split_sizes
from harmony.tasks.profile import ModelProfile
from harmony.tasks.runplan import Job
from harmony.validate import Arguments

RANKING_STEPS = 3  # steps simulated to rank modes and sub-array sizes: their ranking settles within two or three


@dataclass(frozen=True)
class Candidate:
    """A job while the plan is decided: what the plan will say of it, what it computes with, and the pilot's
    profile it is cut from (re-cut when homed jobs take room)."""

    job: Job
    code: JobCode
    profile: ModelProfile


def model_device(model: nn.Module) -> torch.device:
    tensor = next(iter([*model.parameters(), *model.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _to_device(tree: Any, device: torch.device) -> Any:
    """A copy of tree's tensors on device (a copy, so that the pilot pass cannot alter the user's batch)."""
    return tree_map(lambda t: t.to(device, copy=True) if isinstance(t, torch.Tensor) else t, tree)


def pilot_batch(args: Arguments, model: int) -> tuple[Any, Any, list[int]]:
    """The first micro-batch of the model's loader (inputs, targets, on the model's device) and the sizes of
    the first batch's micro-batches."""
    inputs, targets = args.first_batch(model)
    sizes = split_sizes(batch_size(inputs), args.options.microbatches)
    device = model_device(args.models[model])
    return _to_device(split_tree(inputs, sizes)[0], device), _to_device(split_tree(targets, sizes)[0], device), sizes


def step_samples(args: Arguments, job: Job) -> int:
    """The samples of one step of the job: its loader's first batch (what a step is planned for)."""
    return batch_size(args.loaders[job.feed].first[0])
