"""Profile data of a model's layer chain, as measured by the pilot pass: bytes per layer and times."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from harmony.tasks.layout import TensorSpec

BACKWARD_RATIO = 2.0  # a backward's seconds per forward's where the pilot did not measure them


@dataclass(frozen=True)
class LayerProfile:
    """One layer of a model's chain.

    Byte counts of activations are per sample so that they scale with the micro-batch size.
    ``cut_before`` says whether a pack may start at this layer: the values flowing into it are tensors, and it does
    not write them in place (an in-place activation: a pack's input is kept for its backward and is an autograd
    leaf there, so the layer stays in the pack of the layer before it, as in the model it writes that one's output).
    ``borrowed`` are parameters the layer reads that an earlier layer holds (tied weights: a language model's
    head reading its embedding), named as this layer names them; ``lenders`` says, for each, which layer holds
    it and under what name. Their bytes count as this layer's weights and gradients (a pack without the lender
    copies them in and computes their gradients), but they are not its own parameters. ``halved`` are the own
    parameters that autocast only casts (measured under a lower precision, see runtime.halving): a swapped pack may
    hold their device copy in autocast's dtype. ``draws``: its forward drew from the random generator in the pilot
    (dropout in training mode), so that it draws from a stream of its own (runtime.seeding). ``saved_bytes_per_sample``:
    what its forward keeps for its backward beyond its input, its output and its weights (a block's internals: an
    MLP's hidden activations, attention's probabilities), counted like outputs in a pack's workspace; ``saved_bytes``
    the part of it that does not grow with the micro-batch (a parametrized weight, a causal mask).
    ``transient_bytes_per_sample``: what its backward allocates at once beyond what the workspace reserves for it
    (the gradients of its input, output and kept internals, its largest weight's fresh gradient): a block that
    recomputes its internals in its backward (gradient checkpointing inside the model) holds them then;
    ``transient_bytes`` the part of it that does not grow with the micro-batch. ``copied``: the
    float32 parameters (own and borrowed) that autocast casts for some op: each forward makes a 2-byte copy of one,
    held until its backward ends (saved for it, or in autocast's cache), but of a halved one the device holds in
    that dtype already (copy_bytes). Its byte counts are computed once (cached_property: planning reads them in
    loops over packs and caps); a profile is never changed in place (dataclasses.replace makes a new one).
    """

    description: str
    params: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]
    frozen: frozenset[str] = frozenset()
    input_bytes_per_sample: float = 0.0
    output_bytes_per_sample: float = 0.0
    saved_bytes_per_sample: float = 0.0
    saved_bytes: int = 0
    transient_bytes_per_sample: float = 0.0
    transient_bytes: int = 0
    forward_seconds_per_sample: float = 0.0
    cut_before: bool = True
    borrowed: tuple[TensorSpec, ...] = ()
    lenders: tuple[tuple[int, str], ...] = ()
    halved: frozenset[str] = frozenset()
    copied: frozenset[str] = frozenset()
    draws: bool = False

    @cached_property
    def param_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.params)

    @cached_property
    def borrowed_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.borrowed)

    @cached_property
    def buffer_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.buffers)

    @cached_property
    def weight_bytes(self) -> int:
        """Everything that is swapped in for the layer to run: parameters (borrowed ones too) and buffers."""
        return self.param_bytes + self.buffer_bytes + self.borrowed_bytes

    @cached_property
    def halved_bytes(self) -> int:
        """The float32 bytes of the parameters whose device copy may be in autocast's 2-byte dtype."""
        return sum(spec.nbytes for spec in self.params if spec.name in self.halved)

    @cached_property
    def device_bytes(self) -> int:
        """weight_bytes as a swapped pack holds them on its device: the halved parameters at half their bytes."""
        return self.weight_bytes - self.halved_bytes // 2

    @cached_property
    def copy_bytes(self) -> int:
        """What autocast's copies of its weights hold while it runs, where the device holds the halved ones halved
        (a job that holds them in float32 adds their copies: Pack.float_workspace)."""
        return sum(spec.nbytes // 2 for spec in (*self.params, *self.borrowed)
                   if spec.name in self.copied and spec.name not in self.halved)

    @cached_property
    def grad_bytes(self) -> int:
        return sum(spec.nbytes for spec in (*self.params, *self.borrowed) if spec.name not in self.frozen)

    @cached_property
    def largest_param_bytes(self) -> int:
        return max((spec.nbytes for spec in (*self.params, *self.borrowed)), default=0)


@dataclass(frozen=True)
class ModelProfile:
    """A model decomposed into a chain of layers, with the pilot micro-batch size it was measured at.

    ``backward_ratio`` is a backward's seconds per forward's through the whole chain, as the pilot measured them
    (BACKWARD_RATIO where it did not: a model with nothing to train, or too many activations to keep); a pack's
    backward is predicted at its forward times this. ``update_seconds_per_byte`` is its own optimizer's step per
    trainable parameter byte, as the planner measured it on probes of its parameters (runtime.measure.update_time;
    None where it did not): what a homed job's update is predicted at."""

    name: str
    layers: tuple[LayerProfile, ...]
    pilot_samples: int = 1
    notes: tuple[str, ...] = field(default_factory=tuple)
    backward_ratio: float = BACKWARD_RATIO
    update_seconds_per_byte: float | None = None

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def weight_bytes(self) -> int:
        """The model's weights, each tied parameter once."""
        return sum(layer.weight_bytes - layer.borrowed_bytes for layer in self.layers)
