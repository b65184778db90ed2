"""Check and normalize harmony.train's arguments before anything starts; every error names model and argument."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle
import torch
from distributed import Client
from torch import nn

from harmony import timings
from harmony.errors import InputError
from harmony.runtime.data import batch_size
from harmony.runtime.devices import DeviceSpecError, parse_devices
from harmony.runtime.pilot import Exports
from harmony.runtime.schedule import Schedule, Scheduled
from harmony.sizes import parse_bandwidths, parse_size
from harmony.tasks.binding import MODES, POLICIES
from harmony.tasks.profile import ModelProfile
from harmony.tasks.pruning import PRUNERS, Pruner
from harmony.tasks.runplan import PRECISIONS, Options


@dataclass
class Loader:
    """A loader, the iterator its first batch came from, and that first batch."""

    loader: Iterable[Any]
    iterator: Iterator[Any]
    first: tuple[Any, Any]
    keywords: bool = False

    @property
    def source(self) -> Iterable[Any]:
        """The loader as the user gave it."""
        return self.loader.source if isinstance(self.loader, KeywordBatches) else self.loader


class Cut(NamedTuple):
    """A chain the planning cut for a budget and profiled, for a model or an array like it to take (harmony.planner's
    _cut, harmony.fusing's _stacked): the model it was cut from, its layers and the notes on how (an array keeps
    none: its stacks are copies of its members' weights), and its profile."""

    origin: int
    layers: list[nn.Module]
    notes: list[str]
    profile: ModelProfile


@dataclass(frozen=True)
class Arguments:
    """harmony.train's arguments, normalized to one entry per model, and its options."""

    models: list[nn.Module]
    loaders: list[Loader]
    loader_of: list[int]
    loss_fns: list[Callable[..., torch.Tensor] | None]
    optimizers: list[Callable[..., torch.optim.Optimizer] | None]
    optimizer_classes: list[type[torch.optim.Optimizer] | None]
    optimizer_state_ratios: list[float]
    options: Options
    devices: list[str]
    device_memory: int | dict[str, int] | None
    links: list[float | None]
    cluster: str | Client | None
    host_memory: int | None = None
    ahead: bool = False  # micro-batch values are copied ahead (GPUs, or links): packs are cut with room for them
    validation: list[list[tuple[Any, Any]]] = dataclasses.field(default_factory=list)
    validation_of: list[int] = dataclasses.field(default_factory=list)
    metrics: Any = None
    names: list[str] | None = None
    clips: list[float | None] = dataclasses.field(default_factory=list)  # each model's clip_grad_norm (None: off)
    pruner: Pruner | None = None
    prune: str | None = None  # the pruner's name: a built-in's, or the callable's qualified name
    exports: Exports = dataclasses.field(default_factory=lambda: Exports(timings.EXPORTS), compare=False,
                                         repr=False)  # the planning's, kept for later calls once it is over
    cuts: dict[Hashable, Cut] = dataclasses.field(default_factory=dict, compare=False, repr=False)  # the planning's

    def planned(self) -> None:
        """Drop what only the planning needed: its exports and cuts (graphs and chains), which the run never
        reads."""
        self.exports.clear()
        self.cuts.clear()

    def expected_steps(self, model: int) -> int | None:
        """How many steps a model will train, when its loader knows its length (or steps= says)."""
        if self.options.steps is not None:
            return self.options.steps
        try:
            return self.options.epochs * len(self.loaders[self.loader_of[model]].loader)  # type: ignore[arg-type]
        except TypeError:
            return None

    def first_batch(self, model: int) -> tuple[Any, Any]:
        """The first (inputs, targets) batch of the model's loader."""
        return self.loaders[self.loader_of[model]].first

    def batch_sizes(self, model: int) -> set[int] | None:
        """The sizes of the batches the model's loader gives it over its run, where the loader says them without
        being read: a list or tuple of batches, a DataLoader batching a sized dataset by its batch_size (a short
        last batch unless drop_last, where steps= reaches it); None for any other."""
        loader, steps = self.loaders[self.loader_of[model]].source, self.options.steps
        if isinstance(loader, (list, tuple)):
            return {batch_size(batch if _is_keyword_batch(batch) else batch[0])
                    for batch in (loader if steps is None else loader[:steps])}
        if not isinstance(loader, torch.utils.data.DataLoader) or loader.batch_size is None:
            return None
        try:
            full, short = divmod(len(loader.sampler), loader.batch_size)  # type: ignore[arg-type]
        except TypeError:  # an iterable dataset's sampler has no length
            return None
        reached = short and not loader.drop_last and (steps is None or steps > full)
        return ({loader.batch_size} if full else set()) | ({short} if reached else set())


def model_label(index: int, model: nn.Module) -> str:
    return f"model {index} ({type(model).__name__})"


def _check_parameters(index: int, model: nn.Module) -> None:
    """A model Harmony can train: its parameters hold data, and some of them train."""
    label = model_label(index, model)
    meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if meta:
        raise InputError(f"{label} has parameters on the meta device ({', '.join(meta[:3])}"
                         f"{', ...' if len(meta) > 3 else ''}): they hold no values to train; build it on the CPU "
                         "(or load its weights, e.g. with to_empty() and load_state_dict) before training")
    if not any(parameter.requires_grad for parameter in model.parameters()):
        raise InputError(f"{label} has no trainable parameters (none, or all with requires_grad=False): there is "
                         "nothing to train")


def check_models(models: Any) -> list[nn.Module]:
    """The models as a list, each a distinct module with values to train (meta-device parameters refused)."""
    if isinstance(models, nn.Module):
        models = [models]
    if not isinstance(models, (list, tuple)):
        raise InputError(f"models must be an nn.Module or a list of them, got {type(models).__name__}")
    if not models:
        raise InputError("models is empty: pass an nn.Module or a non-empty list of nn.Modules")
    seen: dict[int, int] = {}
    for index, model in enumerate(models):
        if not isinstance(model, nn.Module):
            raise InputError(f"models[{index}] is a {type(model).__name__}, not a torch.nn.Module")
        if id(model) in seen:
            raise InputError(
                f"models[{index}] is the same module object as models[{seen[id(model)]}]; pass distinct "
                "modules (copy.deepcopy one to train two copies)"
            )
        seen[id(model)] = index
        _check_parameters(index, model)
    return list(models)


def _is_batch(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and _has_tensor(value[0])


def _is_keyword_batch(value: Any) -> bool:
    """A Hugging Face style batch: a dict of tensors ({"input_ids", "attention_mask", "labels"}), passed to the
    model as keyword arguments."""
    return isinstance(value, Mapping) and _has_tensor(dict(value))


class KeywordBatches:
    """A loader of dict batches as one of (inputs, targets) pairs: the dict is the inputs (the model takes it as
    keyword arguments) and there are no targets (the model computes its own loss, from the labels in the dict)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.source = loader

    def __iter__(self) -> Iterator[tuple[Any, None]]:
        return ((dict(batch), None) for batch in self.source)

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return False


def _peek(loader: Any, label: str, passes: bool) -> Loader:
    try:
        iterator = iter(loader)
    except TypeError:
        raise InputError(f"{label} is a {type(loader).__name__}, which is not iterable; pass a DataLoader "
                         "or any re-iterable of (inputs, targets) batches") from None
    if passes and iterator is loader:
        raise InputError(
            f"{label} is an iterator that can be read only once, but training needs more than one pass; "
            "pass a DataLoader or a list of batches"
        )
    try:
        first = next(iterator)
    except StopIteration:
        raise InputError(f"{label} yields no batches") from None
    if _is_keyword_batch(first):
        wrapped = KeywordBatches(loader)
        return Loader(wrapped, ((dict(batch), None) for batch in iterator), (dict(first), None), keywords=True)
    if not _is_batch(first):
        kind = type(first).__name__ + (f" of length {len(first)}" if isinstance(first, (tuple, list)) else "")
        raise InputError(
            f"{label} yields a {kind}; every batch must be an (inputs, targets) pair whose inputs hold tensors, "
            "or a dict of tensors that the model takes as keyword arguments"
        )
    if batch_size(first[0]) < 1:
        raise InputError(f"{label}: the inputs of a batch need a batch dimension (dim 0) of at least 1 sample")
    return Loader(loader, iterator, (first[0], first[1]))


def _looks_like_batch(value: Any) -> bool:
    """A batch (maybe a malformed one) rather than a loader given as a list of batches.

    A tuple holding tensors is a batch; so is a list whose first item is a tensor or a dict of them
    (what a DataLoader yields). A list whose first item is a tuple is a loader: a list of batches.
    """
    if isinstance(value, tuple):
        return _has_tensor(value)
    if _is_keyword_batch(value):
        return True
    if isinstance(value, list) and value and all(_is_keyword_batch(item) for item in value):
        return False  # a list of dict batches: a loader
    return isinstance(value, list) and bool(value) and isinstance(value[0], (torch.Tensor, dict))


def _loaders(loaders: Any, count: int, passes: bool, argument: str = "loaders") -> tuple[list[Loader], list[int]]:
    """One loader shared by every model, or one per model; a list of batches is one loader."""
    per_model = isinstance(loaders, (list, tuple)) and not (loaders and _looks_like_batch(loaders[0]))
    if not per_model:
        return [_peek(loaders, argument, passes)], [0] * count
    if len(loaders) != count:
        raise InputError(
            f"got {len(loaders)} {argument} for {count} models; pass one loader shared by all models or "
            "a list with exactly one loader per model"
        )
    peeked: list[Loader] = []
    loader_of = []
    for index, loader in enumerate(loaders):
        shared = next((i for i, known in enumerate(peeked) if known.source is loader), None)
        if shared is None:
            peeked.append(_peek(loader, f"{argument}[{index}] (for model {index})", passes))
            shared = len(peeked) - 1
        loader_of.append(shared)
    return peeked, loader_of


def _per_model(value: Any, count: int, argument: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InputError(f"got {len(value)} entries in {argument} for {count} models; pass one shared "
                             f"{argument} or exactly one per model")
        return list(value)
    return [value] * count


def own_loss(output: Any, target: Any) -> torch.Tensor:
    """The loss a model computed itself (a Hugging Face model given labels): loss_fn=None."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"loss_fn=None takes the model's own loss (output.loss), but its {type(output).__name__} "
                         "output has none: pass labels in the batch, or a loss_fn")
    return loss


def _loss_fns(loss_fn: Any, models: list[nn.Module]) -> list[Callable[..., torch.Tensor]]:
    fns = _per_model(loss_fn, len(models), "loss_fn")
    fns = [own_loss if fn is None else fn for fn in fns]
    for index, fn in enumerate(fns):
        if not callable(fn):
            raise InputError(f"loss_fn for {model_label(index, models[index])} is a {type(fn).__name__}, "
                             "not a callable(output, target) -> scalar tensor")
    return fns


def _optimizers(
    optimizer: Any, models: list[nn.Module]
) -> tuple[list[Callable[..., torch.optim.Optimizer]], list[type[torch.optim.Optimizer] | None]]:
    """The optimizer factory of every model, and the class of optimizer each builds (from one probe call)."""
    if optimizer is None:
        raise InputError("optimizer is required: a factory such as lambda params: torch.optim.SGD(params, lr=0.1)")
    factories = _per_model(optimizer, len(models), "optimizer")
    classes: list[type[torch.optim.Optimizer] | None] = []
    for index, factory in enumerate(factories):
        label = model_label(index, models[index])
        if isinstance(factory, torch.optim.Optimizer):
            raise InputError(
                f"optimizer for {label} is an optimizer instance ({type(factory).__name__}); Harmony builds one "
                f"optimizer per layer pack, so pass a factory instead, e.g. "
                f"lambda params: torch.optim.{type(factory).__name__}(params, lr=...)"
            )
        if not callable(factory):
            raise InputError(f"optimizer for {label} is a {type(factory).__name__}, not a factory "
                             "callable(params) -> torch.optim.Optimizer")
        probe = [nn.Parameter(torch.zeros(1))]
        try:
            built = factory(probe)
        except Exception as error:
            raise InputError(f"optimizer factory for {label} failed when called with a list of parameters: "
                             f"{type(error).__name__}: {error}") from error
        if not isinstance(built, torch.optim.Optimizer):
            raise InputError(f"optimizer factory for {label} returned a {type(built).__name__}, "
                             "not a torch.optim.Optimizer")
        if any(all(param is not given for given in probe) for group in built.param_groups for param in group["params"]):
            raise InputError(f"optimizer factory for {label} built an optimizer over other parameters than the ones "
                             "it was given (Harmony gives it the copies it trains): build it over its argument, as "
                             "lambda params: torch.optim.SGD(params, lr=0.1)")
        classes.append(type(built))
    return factories, classes


SCHEDULE_USAGE = ("lr_schedule must be a callable(step) -> factor of the initial learning rate, as LambdaLR's "
                  "lr_lambda (for a scheduler such as transformers' get_cosine_schedule_with_warmup, pass its "
                  "lr_lambdas[0])")


def _lr_schedules(lr_schedule: Any, models: list[nn.Module]) -> list[Schedule | None]:
    """Every model's learning-rate schedule (None: constant): a callable that crosses to the workers (its values
    are checked once the run's length is known, check_schedules)."""
    schedules = _per_model(lr_schedule, len(models), "lr_schedule")
    for index, schedule in enumerate(schedules):
        if schedule is None:
            continue
        label = model_label(index, models[index])
        if isinstance(schedule, torch.optim.lr_scheduler.LRScheduler) or (
            isinstance(schedule, type) and issubclass(schedule, torch.optim.lr_scheduler.LRScheduler)
        ):
            kind = schedule.__name__ if isinstance(schedule, type) else type(schedule).__name__
            raise InputError(f"lr_schedule for {label} is a scheduler ({kind}); Harmony steps one optimizer per "
                             f"layer pack, so {SCHEDULE_USAGE}")
        if not callable(schedule):
            raise InputError(f"lr_schedule for {label} is a {type(schedule).__name__}; {SCHEDULE_USAGE}")
        try:
            cloudpickle.dumps(schedule)
        except Exception as error:
            raise InputError(f"lr_schedule for {label} cannot be pickled for the workers ({type(error).__name__}: "
                             f"{error}); define it at module level or as a lambda or functools.partial") from error
    return schedules


def _factor(value: Any) -> bool:
    """Whether a schedule's value is a finite factor >= 0."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < float("inf")


def check_schedules(args: Arguments) -> None:
    """Every scheduled model's schedule at every step of its run (its first 100,000 where the run's length is not
    known): a finite factor >= 0, or an InputError naming the step, before any work starts."""
    for index, factory in enumerate(args.optimizers):
        if not isinstance(factory, Scheduled):
            continue
        label = model_label(index, args.models[index])
        for step in range(min(args.expected_steps(index) or 100_000, 100_000)):
            try:
                factor = factory.schedule(step)
            except Exception as error:
                raise InputError(f"lr_schedule for {label} failed at step {step} ({type(error).__name__}: {error}); "
                                 f"{SCHEDULE_USAGE}") from error
            if not _factor(factor):
                raise InputError(f"lr_schedule for {label} gave {factor!r} at step {step}, not a finite factor >= 0; "
                                 f"{SCHEDULE_USAGE}")


def _clips(clip_grad_norm: Any, models: list[nn.Module], options: Options) -> list[float | None]:
    """Every model's largest total gradient norm (None: not clipped), each a finite number > 0; clipping decides
    every update of a step from all of its gradients, so it takes upd tasks on the host store."""
    clips = _per_model(clip_grad_norm, len(models), "clip_grad_norm")
    for index, clip in enumerate(clips):
        if clip is None:
            continue
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < float("inf"):
            raise InputError(f"clip_grad_norm for {model_label(index, models[index])} is {clip!r}; it must be the "
                             "largest total gradient norm, a finite number > 0 (as clip_grad_norm_'s max_norm), or "
                             "None")
    if any(clip is not None for clip in clips):
        if options.overlap_update is False:
            raise InputError("clip_grad_norm steps a swapped model's packs in upd tasks once its whole backward is "
                             "done (the norm is every pack's gradients'): leave overlap_update as None")
        if options.update_on == "device":
            raise InputError("update_on='device' steps a swapped pack's optimizer in its backward task; "
                             "clip_grad_norm decides every update of a step from all of its gradients, on the host: "
                             "leave update_on as 'auto'")
    return [None if clip is None else float(clip) for clip in clips]


def optimizer_state_ratio(factory: Callable[..., torch.optim.Optimizer]) -> float:
    """Bytes of optimizer state per parameter byte, from one step on a probe parameter (2.0 if unknown)."""
    probe = nn.Parameter(torch.zeros(64))
    probe.grad = torch.zeros(64)
    try:
        optimizer = factory([probe])
        optimizer.step()
    except Exception:
        return 2.0
    state = optimizer.state.get(probe, {})
    per_element = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return per_element / (probe.numel() * probe.element_size())


def _positive_int(value: Any, argument: str, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{argument}={value!r} must be a positive integer")
    return value


def validate(
    models: Any,
    loaders: Any,
    loss_fn: Any,
    optimizer: Any,
    options: Options,
    devices: Any,
    device_memory: Any,
    cluster: Any = None,
    link_bandwidth: Any = None,
    for_training: bool = True,
    host_memory: Any = None,
    lr_schedule: Any = None,
    clip_grad_norm: Any = None,
) -> Arguments:
    """Normalize and check every argument; raises InputError before any work starts.

    Planning needs no loss or optimizer: with for_training=False they may be None.
    """
    model_list = check_models(models)
    check_options(options)
    planning_only = not for_training
    loss_fns = [None] * len(model_list) if planning_only and loss_fn is None else _loss_fns(loss_fn, model_list)
    optimizers, optimizer_classes = (
        ([None] * len(model_list), [None] * len(model_list))
        if planning_only and optimizer is None
        else _optimizers(optimizer, model_list)
    )
    optimizers = [factory if schedule is None or factory is None else Scheduled(factory, schedule)
                  for factory, schedule in zip(optimizers, _lr_schedules(lr_schedule, model_list))]
    passes = options.steps is None and options.epochs > 1
    loader_list, loader_of = _loaders(loaders, len(model_list), passes)
    for index, loader_index in enumerate(loader_of):
        samples = batch_size(loader_list[loader_index].first[0])
        if options.microbatches != "auto" and options.microbatches > samples:
            raise InputError(
                f"microbatches={options.microbatches} is larger than the first batch of "
                f"{model_label(index, model_list[index])}'s loader ({samples} samples); use at most {samples} "
                "micro-batches or larger batches"
            )
    device_list, budget, links = check_devices(devices, device_memory, link_bandwidth, cluster, for_training)
    try:
        host_budget = None if host_memory is None else parse_size(host_memory, "host_memory")
    except ValueError as error:
        raise InputError(str(error)) from None
    arguments = Arguments(
        models=model_list,
        loaders=loader_list,
        loader_of=loader_of,
        loss_fns=loss_fns,
        optimizers=optimizers,
        optimizer_classes=optimizer_classes,
        optimizer_state_ratios=[2.0 if f is None else optimizer_state_ratio(f) for f in optimizers],
        options=options,
        devices=device_list,
        device_memory=budget,
        links=links,
        cluster=cluster,
        host_memory=host_budget,
        ahead=options.ahead and (any(links) or any(device.startswith("cuda") for device in device_list)),
        clips=_clips(clip_grad_norm, model_list, options),
    )
    check_schedules(arguments)
    return arguments


def check_validation(
    val_loaders: Any, metrics: Any, names: Any, options: Options, models: list[nn.Module]
) -> tuple[list[list[tuple[Any, Any]]], list[int], list[str] | None]:
    """The validation batches (every batch of each validation loader, read once), which of them each model is
    evaluated on, and the models' names; eval_every and metrics need val_loaders."""
    if val_loaders is None:
        for argument, value in (("eval_every", options.eval_every), ("metrics", metrics)):
            if value is not None:
                raise InputError(f"{argument} needs val_loaders: the validation data every model is evaluated on")
        sets, validation_of = [], []
    else:
        loaders, validation_of = _loaders(val_loaders, len(models), passes=False, argument="val_loaders")
        sets = []
        for index, loader in enumerate(loaders):
            batches = []
            for batch in [loader.first, *loader.iterator]:
                if not (loader.keywords or _is_batch(batch)):
                    raise InputError(f"val_loaders: loader {index} yields a {type(batch).__name__} after its first "
                                     "batch; every batch must be like the first")
                batches.append((batch[0], batch[1]))
            sets.append(batches)
    if metrics is not None and not callable(metrics) and not (
            isinstance(metrics, Mapping) and all(callable(fn) for fn in metrics.values())):
        raise InputError(f"metrics={metrics!r} must be a callable(output, target) -> number (or dict of numbers), "
                         "or a dict of name -> such callable")
    if names is not None:
        if not isinstance(names, (list, tuple)) or len(names) != len(models):
            raise InputError(f"names must be a list of one name per model ({len(models)}), got {names!r}")
        names = [str(name) for name in names]
    return sets, validation_of, names


PRUNE_USAGE = (f"prune must be one of {sorted(PRUNERS)} or a callable(step, standings) -> the indices of the models "
               "to stop, standings being the models still training, each with .index .name .val_loss .metrics")


def check_prune(prune: Any, options: Options, validation: bool) -> tuple[Pruner | None, str | None]:
    """The pruner and its name (None, None: no pruning); it ranks models by their evaluations within the run, so it
    needs val_loaders and eval_every."""
    if prune is None:
        return None, None
    if isinstance(prune, str):
        if prune not in PRUNERS:
            raise InputError(f"prune={prune!r} is not a pruner; {PRUNE_USAGE}")
        pruner, name = PRUNERS[prune], prune
    elif callable(prune):
        pruner, name = prune, getattr(prune, "__qualname__", type(prune).__qualname__)
    else:
        raise InputError(f"prune={prune!r}; {PRUNE_USAGE}")
    if not validation:
        raise InputError("prune ranks the models by their validation loss: pass val_loaders, the data they are "
                         "evaluated on")
    if options.eval_every is None:
        raise InputError("prune stops models at the evaluations within the run: pass eval_every, the steps between "
                         "them (each is a pruning step)")
    return pruner, name


def check_devices(devices: Any, device_memory: Any, link_bandwidth: Any, cluster: Any, for_training: bool = True
                  ) -> tuple[list[str], int | dict[str, int] | None, list[float | None]]:
    """The devices, their budgets and links, and the cluster argument, checked: what starting the embedded cluster
    needs, so that it can start before the models are checked."""
    try:
        device_list = parse_devices(devices) if for_training or not isinstance(devices, int) else ["cpu"] * devices
    except DeviceSpecError as error:
        raise InputError(str(error)) from None
    try:
        budget = device_budgets(device_memory)
        links = parse_bandwidths(link_bandwidth, len(device_list))
    except ValueError as error:
        raise InputError(str(error)) from None
    if cluster is not None and not isinstance(cluster, (str, Client)):
        raise InputError(f"cluster={cluster!r} must be None (an embedded cluster), a scheduler address such as "
                         "'tcp://host:8786', or a distributed.Client")
    return device_list, budget, links


def device_budgets(device_memory: Any) -> int | dict[str, int] | None:
    """device_memory as bytes: one budget for every device, or per device (worker) name."""
    if device_memory is None:
        return None
    if isinstance(device_memory, dict):
        if not device_memory:
            raise ValueError("device_memory={} names no worker; give a size, or a dict of worker name -> size")
        return {str(name): parse_size(size, f"device_memory[{name!r}]") for name, size in device_memory.items()}
    return parse_size(device_memory, "device_memory")


def read_options(arguments: Mapping[str, Any]) -> Options:
    """The run's options from harmony.train's keyword arguments (every field of Options by name)."""
    values = {field.name: arguments.get(field.name, field.default) for field in dataclasses.fields(Options)}
    flags = {name: bool(values[name]) for name in ("group", "resident", "fail_fast")}
    if not isinstance(values["prefetch"], str):  # "weights", or a string check_options refuses
        flags["prefetch"] = bool(values["prefetch"])
    return Options(**{**values, **flags})


def check_options(options: Options) -> None:
    """Every option's value, before anything starts."""
    _positive_int(options.epochs, "epochs")
    _positive_int(options.steps, "steps", allow_none=True)
    if options.microbatches != "auto":
        try:
            _positive_int(options.microbatches, "microbatches")
        except InputError:
            raise InputError(f"microbatches={options.microbatches!r} must be a positive integer or 'auto' (the fewest "
                             "micro-batches at which every model's layers fit the device budget)") from None
    if isinstance(options.prefetch, str) and options.prefetch != "weights":
        raise InputError(f"prefetch={options.prefetch!r} is not a prefetch setting; use True (weights, and each "
                         "micro-batch's values copied while the one before computes), 'weights' (weights only) "
                         "or False")
    if options.policy not in POLICIES:
        raise InputError(f"policy={options.policy!r} is not a scheduling policy; use one of {POLICIES}")
    if options.mode not in ("auto", *MODES):
        raise InputError(f"mode={options.mode!r} is not an execution mode; use 'auto', 'free', 'vpp' or 'vdp'")
    check_fuse(options.fuse)
    check_per_task("steps_per_task", options.steps_per_task,
                   "how many consecutive steps one task of a homed model runs", "the measured step time")
    check_per_task("packs_per_task", options.packs_per_task,
                   "how many consecutive packs one task of a swapped model runs", "the measured task cost")
    _positive_int(options.checkpoint_every, "checkpoint_every", allow_none=True)
    _positive_int(options.eval_every, "eval_every", allow_none=True)
    if options.precision not in PRECISIONS:
        raise InputError(f"precision={options.precision!r} is not a precision; use one of {sorted(PRECISIONS)}")
    check_grad_scaler(options.grad_scaler, options.precision)
    if not isinstance(options.compile, bool):
        raise InputError(f"compile={options.compile!r} must be True or False")
    if not isinstance(options.stash, bool):
        raise InputError(f"stash={options.stash!r} must be True or False")
    if options.threads != "auto" and (isinstance(options.threads, bool) or not isinstance(options.threads, int)
                                      or options.threads < 1):
        raise InputError(f"threads={options.threads!r} must be 'auto' (each CPU device times one thread against its "
                         "share of the cores and takes an idle device's) or a count of threads for every device, "
                         "such as 1 (the same threads every run: results reproducible bit for bit)")
    if options.precision == "fp16" and options.overlap_update is False:
        raise InputError("precision='fp16' steps a swapped model's packs in upd tasks once its whole backward is done "
                         "(whether the step is skipped depends on every gradient): leave overlap_update as None")
    if options.update_on not in ("auto", "host", "device"):
        raise InputError(f"update_on={options.update_on!r} must be 'auto', 'host' or 'device'")
    if options.update_on == "device" and (options.overlap_update or options.precision == "fp16"):
        raise InputError("update_on='device' steps a swapped pack's optimizer in its backward task, on its device; "
                         + ("overlap_update=True asks for a task beside the device instead: leave one of them"
                            if options.overlap_update else "precision='fp16' decides every update of a step from "
                            "all of its gradients, on the host: leave update_on as 'auto'"))
    if not any(options.overlap_update is value for value in (None, True, False)):
        raise InputError(f"overlap_update={options.overlap_update!r} must be True, False or None (chosen by "
                         "prediction)")


def check_checkpoints(checkpoint_dir: Any, checkpoint_every: int | None, resume: bool) -> Path | None:
    """The checkpoint directory as a path; checkpoint_every and resume need one."""
    if checkpoint_dir is None:
        if checkpoint_every is not None or resume:
            raise InputError("checkpoint_every and resume need a checkpoint_dir: the directory checkpoints are "
                             "written to and resumed from")
        return None
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise InputError(f"checkpoint_dir={checkpoint_dir!r} must be a path")
    path = Path(checkpoint_dir)
    if path.exists() and not path.is_dir():
        raise InputError(f"checkpoint_dir={checkpoint_dir!r} is a file, not a directory")
    return path


def describe_run(args: Arguments, budgets: dict[str, int]) -> dict[str, Any]:
    """What makes a run itself, for a resumed run to be checked against the checkpoint it takes up: its models'
    architectures, its loaders' batches, its losses and optimizers, its options and its devices (not how fast
    anything ran, nor how often it is checkpointed)."""
    options = dataclasses.asdict(args.options)
    options.pop("checkpoint_every")
    options.pop("threads")  # how fast, and the last bits of a sum: a run may resume with other threads
    return {
        "models": [[type(model).__qualname__, [(name, list(t.shape), str(t.dtype))
                                              for name, t in model.state_dict().items()]] for model in args.models],
        "loaders": [[_length(loader.loader), _shapes(loader.first)] for loader in args.loaders],
        "loader_of": args.loader_of,
        "losses": [getattr(fn, "__qualname__", type(fn).__qualname__) for fn in args.loss_fns],
        "optimizers": [_hyperparameters(factory) for factory in args.optimizers],
        "lr_schedules": [_factors(f, args.expected_steps(index)) for index, f in enumerate(args.optimizers)],
        "clip_grad_norm": args.clips,
        **({"prune": args.prune} if args.prune else {}),  # absent without: older checkpoints stay resumable
        "options": options,
        "devices": budgets,
    }


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _shapes(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return [list(tree.shape), str(tree.dtype)]
    if isinstance(tree, (list, tuple)):
        return [_shapes(item) for item in tree]
    if isinstance(tree, dict):
        return {str(key): _shapes(value) for key, value in tree.items()}
    return repr(tree)


def _factors(factory: Any, steps: int | None) -> str | None:
    """A digest of a scheduled optimizer's factors at every step of its run (its first 10,000 where the run's
    length is unknown): a resume with another schedule is another run."""
    if not isinstance(factory, Scheduled):
        return None
    factors = [float(factory.schedule(step)) for step in range(min(steps or 10_000, 10_000))]
    return hashlib.sha256(repr(factors).encode()).hexdigest()


def _hyperparameters(factory: Any) -> Any:
    """An optimizer factory's class and hyperparameters, from one call on a probe parameter."""
    if factory is None:
        return None
    built = factory([nn.Parameter(torch.zeros(1))])
    groups = [{key: repr(value) for key, value in group.items() if key != "params"} for group in built.param_groups]
    return [type(built).__qualname__, groups]


def check_fuse(fuse: Any) -> None:
    """fuse as train and plan take it: "auto", True (as many as fit), False, or a largest sub-array size."""
    if fuse is True or fuse is False or fuse == "auto" or (
        isinstance(fuse, int) and not isinstance(fuse, bool) and fuse >= 1
    ):
        return
    raise InputError(f"fuse={fuse!r} is not a fusion setting; use 'auto' (the default: the sub-array size with the "
                     "best predicted throughput), True (the largest sub-arrays that fit), False (no fusion), or a "
                     "positive int (the largest sub-array size to use)")


def check_per_task(name: str, value: Any, meaning: str, auto: str) -> None:
    """steps_per_task or packs_per_task as train takes it: "auto" or a positive int."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise InputError(f"{name}={value!r} must be 'auto' (chosen from {auto}) or a positive int ({meaning})")


SCALER_ARGUMENTS = {"init_scale": float, "growth_factor": float, "backoff_factor": float, "growth_interval": int}


def check_grad_scaler(grad_scaler: Any, precision: str) -> None:
    """grad_scaler as train takes it: None, or with precision="fp16" a dict of torch.amp.GradScaler's arguments."""
    if grad_scaler is None:
        return
    if precision != "fp16":
        raise InputError(f"grad_scaler is for precision='fp16' (the loss is scaled only then), not {precision!r}")
    if not isinstance(grad_scaler, dict) or set(grad_scaler) - set(SCALER_ARGUMENTS):
        raise InputError(f"grad_scaler={grad_scaler!r} must be a dict of torch.amp.GradScaler's arguments: "
                         f"{', '.join(SCALER_ARGUMENTS)}")
    for name, value in grad_scaler.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
                SCALER_ARGUMENTS[name] is int and not isinstance(value, int)):
            raise InputError(f"grad_scaler[{name!r}]={value!r} must be a positive {SCALER_ARGUMENTS[name].__name__}")
