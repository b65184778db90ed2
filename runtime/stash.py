"""A micro-batch's activations kept on the device from a pack's forward to its backward (a stash), not recomputed.

A fwd task with room runs a pack's forward with autograd on and keeps what its backward reads: the graph's saved
tensors, the input (whose gradient bwd returns) and the output (that bwd backpropagates from). The pack's weights
are not part of it, so that a stash never holds weights on the device outside the cache's accounting:

- a saved tensor that is a view of a weight is packed as its place in that weight (saved-tensor hooks) and unpacked
  as the same view of whatever copy of the weight bwd binds (the same version, maybe another buffer);
- the weights' autograd leaves let go of their bytes after the forward, and bwd lends them its copy and its
  gradient buffers before backpropagating, so that gradients accumulate where a recomputing bwd puts them.

A saved view of a weight that cannot be found again (another dtype than the weight's) would pin the weights'
buffer: such a forward is not stashed (pinned). The stash's bytes are every other storage it holds, each counted
once; the cache keeps it as an evictable entry (tasks.memory), and a bwd that does not find it recomputes.
A pack whose stash was refused or evicted before its backward is not stashed again for a while (worth_stashing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

Token = tuple[str, int, tuple[int, ...], tuple[int, ...]]  # a weight's name, offset from it, size, stride
RETRY = 8  # steps a pack's forward runs without gradients after its stash was first lost (doubling with each loss)


def worth_stashing(missed: tuple[int, int] | None, step: int) -> bool:
    """Whether a pack's forward at step should stash, given the last step whose stash for it was lost and how many
    steps in a row lost one (missed; None since one reached its backward). A stash that does not last costs the
    forward autograd's bookkeeping, and the weights it pushed out their copies, for nothing: after a loss the pack
    runs without gradients for RETRY steps, twice as long after each further loss (up to 64 times), and then tries
    again, since the device's load may have changed (a model of the sweep finished)."""
    if missed is None:
        return True
    lost, streak = missed
    return step == lost or step >= lost + RETRY * 2 ** min(streak - 1, 6)


class Stash:
    """One micro-batch through one pack, with autograd: its output, input and graph, without the weights' bytes."""

    def __init__(self, tensors: dict[str, torch.Tensor], trainable: Iterable[str]) -> None:
        self._names = {(tensor.untyped_storage().data_ptr(), tensor.dtype): name for name, tensor in tensors.items()}
        self._made = tensors
        self._bound: dict[str, torch.Tensor] = {}
        self._storages: dict[int, int] = {}
        self.leaves = {name: tensors[name].detach().requires_grad_() for name in trainable}
        self.pinned = False
        self.x: Any = None
        self.y: Any = None

    def forward(self, call: Callable[[dict[str, torch.Tensor], Any], Any], x: Any, autocast: AbstractContextManager,
                track: Callable[[Any], None]) -> Any:
        """Run call(weights, x) with gradients, keeping its graph; returns the output (which the graph holds)."""
        track(x)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), autocast:
            y = call({**self._made, **self.leaves}, x)
        for leaf in self.leaves.values():
            leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
        self._made = {}
        self.x, self.y = x, y
        for value in (x, y):
            for leaf in tree_leaves(value):
                if isinstance(leaf, torch.Tensor):
                    self._storages[leaf.untyped_storage().data_ptr()] = leaf.untyped_storage().nbytes()
        return y

    @property
    def nbytes(self) -> int:
        """The device bytes it holds: every storage of its saved tensors, input and output, once."""
        return sum(self._storages.values())

    def _pack(self, tensor: torch.Tensor) -> Token | torch.Tensor:
        storage = tensor.untyped_storage()
        name = self._names.get((storage.data_ptr(), tensor.dtype))
        if name is not None:
            offset = tensor.storage_offset() - self._made[name].storage_offset()
            return name, offset, tuple(tensor.shape), tensor.stride()
        if any(pointer == storage.data_ptr() for pointer, _ in self._names):
            self.pinned = True  # a view of the weights' buffer in another dtype: it would hold the buffer
        self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def _unpack(self, packed: Token | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        name, offset, size, stride = packed
        weight = self._bound[name]
        return torch.as_strided(weight, size, stride, weight.storage_offset() + offset)

    def backward(self, tensors: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], halved: set[str],
                 upstream: Any, backpropagate: Callable[[Any, Any], None]) -> Any:
        """Backpropagate upstream from the output with the pack's weights bound to tensors (bwd's copy, at the
        forward's version), accumulating into grads (a halved weight's gradient is added after, in float32, as a
        recomputing bwd does); returns the input, whose leaves now hold their gradients. The stash is spent."""
        self._bound = tensors
        for name, leaf in self.leaves.items():
            leaf.data = tensors[name]
            if name not in halved:
                leaf.grad = grads[name]
        backpropagate(self.y, upstream)
        for name in halved & self.leaves.keys():
            if self.leaves[name].grad is not None:
                grads[name].add_(self.leaves[name].grad)
        x = self.x
        self.x = self.y = None
        self.leaves = {}
        self._bound = {}
        return x


def detached(tree: Any) -> Any:
    """tree with its tensors out of autograd (a stashed forward's output, as the next pack and the host see it)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach()
    return tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, tree)


def stash_key(model: int, pack: int, step: int, group: int, microbatch: int, attempt: int) -> tuple[Any, ...]:
    """Where the stash of one micro-batch of one group through one pack of a job at a step is kept in the cache, by
    the attempt of the step's tasks that made it: a span run again never reads a stash an earlier attempt left
    (runtime.bodies.Attempt)."""
    return ("stash", model, pack, step, group, microbatch, attempt)
