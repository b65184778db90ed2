"""Attention of a fused array's members as one call: the members fold into the batch dimension.

torch has no batching rule for ``scaled_dot_product_attention`` (its CPU and CUDA kernels), so under vmap it loops
over the members, one kernel call each, and torch.library's vmap rules apply to custom operators only.
``FoldedAttention`` intercepts the call within a vmap, takes the members' tensors out of vmap's wrapping (members
first), runs one attention over members x batch and wraps the result back: the same kernel on the same rows, so the
same values and gradients (autograd records the call on the unwrapped tensors, as it does a batching rule's).

It folds a call whose query, key and value are each four-dimensional per member (batch, heads, tokens, features,
the layout of Hugging Face's and torch's attention), run below the vmap as a batching rule is (the vmap's
interpreter lowered): a dropout then draws its masks for members x batch in one call, each member its own, as the
array's vmap asks (``randomness="different"``; under another randomness a call with dropout keeps the loop). Any
other call keeps vmap's loop. Where members x batch would exceed what one call of CUDA's kernels takes (ROWS,
ELEMENTS), the members are folded a few at a time. A mask broadcast over the batch or shared by the members is
expanded to the folded batch (its gradient, where it needs one, summed over the expansion: vmap's loop cannot
differentiate such a mask at all). nn.MultiheadAttention's functional form, which a TorchFunctionMode sees only as a
whole, runs as a copy whose call of attention is the mode's.
"""

from __future__ import annotations

from types import FunctionType
from typing import Any

import torch
from torch import nn
from torch._C import _functorch
from torch._functorch.pyfunctorch import VmapInterpreter, coerce_cinterpreter
from torch.overrides import TorchFunctionMode

ATTENTION = nn.functional.scaled_dot_product_attention
MULTI_HEAD = nn.functional.multi_head_attention_forward  # nn.MultiheadAttention's, which calls ATTENTION within
ROWS = 65535  # the batch rows CUDA's efficient and flash kernels take in one call (their grid's limit, pytorch#146704)
ELEMENTS = 2**31 - 1  # the query elements (tokens rounded up to 128, features to 32) flash's backward indexes
NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
DEFAULTS = (None, None, None, None, 0.0, False, None, False)


class FoldedAttention(TorchFunctionMode):
    """Within the block (inside a vmap), attention runs as ``folded`` where it can; calls counts the calls made,
    folds those folded."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.folds = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func is ATTENTION:
            return self.attend(*args, **kwargs)
        if func is MULTI_HEAD:  # its own call of attention, as ours: a copy of it that looks the name up here
            inner = FunctionType(func.__code__, {**func.__globals__, "scaled_dot_product_attention": self.attend},
                                 func.__name__, func.__defaults__, func.__closure__)
            inner.__kwdefaults__ = func.__kwdefaults__
            return inner(*args, **kwargs)
        return func(*args, **kwargs)

    def attend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """scaled_dot_product_attention, folded where it can be."""
        self.calls += 1
        out = folded(**{**dict(zip(NAMES, DEFAULTS)), **dict(zip(NAMES, args)), **kwargs})
        if out is None:
            return ATTENTION(*args, **kwargs)
        self.folds += 1
        return out


def folded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
           dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor | None:
    """The attention of every member at once, as the innermost vmap sees it, run below that vmap as a batching rule
    runs (its interpreter lowered: a dropout draws for members x batch at once, each member its own); None where it
    cannot fold (not within a vmap, no tensor batched by it, a tensor not 4-D per member, dropout under a vmap whose
    members must draw alike or not at all)."""
    top = _functorch.peek_interpreter_stack()
    interpreter = None if top is None else coerce_cinterpreter(top)
    if not isinstance(interpreter, VmapInterpreter) or any(t.dim() != 4 for t in (query, key, value)):
        return None
    if dropout_p > 0 and interpreter.randomness() != "different":
        return None
    level, members = interpreter.level(), interpreter.batch_size()
    tensors = (query, key, value)
    if not any(_functorch.maybe_get_level(t) == level for t in tensors):
        return None
    q, k, v = (_members_first(t, level, members).flatten(0, 1) for t in tensors)
    mask = None if attn_mask is None else _mask(attn_mask, level, members, query.shape[0])
    rows = query.shape[0] * _per_call(query)  # members x batch rows a call takes
    starts = range(0, q.shape[0], rows)
    masks = [mask if mask is None or mask.shape[0] == 1 else mask[start : start + rows] for start in starts]
    with interpreter.lower():
        outs = [ATTENTION(q[start : start + rows], k[start : start + rows], v[start : start + rows], attn_mask=part,
                          dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
                for start, part in zip(starts, masks)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return _functorch._add_batch_dim(out.unflatten(0, (members, -1)), 0, level)


def _per_call(query: torch.Tensor) -> int:
    """How many members' attention one call takes, for a member's query of (batch, heads, tokens, features): as
    many as keep the call within ROWS batch rows and ELEMENTS rounded query elements (at least one, the call
    vmap's loop makes)."""
    batch, heads, tokens, features = query.shape
    elements = batch * heads * -(-tokens // 128) * 128 * max(features, 32)
    return max(1, min(ROWS // max(batch, 1), ELEMENTS // max(elements, 1)))


def _unwrapped(t: torch.Tensor, level: int) -> torch.Tensor:
    """t's members' tensor, members first (t is batched at level)."""
    inner, dim = _functorch._unwrap_batched(t, level)
    return inner.movedim(dim, 0)


def _members_first(t: torch.Tensor, level: int, members: int) -> torch.Tensor:
    """t as members x its per-member shape: unwrapped where batched at level, else the same for every member."""
    if _functorch.maybe_get_level(t) == level:
        return _unwrapped(t, level)
    return t.unsqueeze(0).expand(members, *t.shape)


def _mask(mask: torch.Tensor, level: int, members: int, batch: int) -> torch.Tensor:
    """The members' mask for attention over members x batch: broadcastable to (members x batch, heads, queries,
    keys); a mask shared by the members and the batch stays as it is."""
    batched = _functorch.maybe_get_level(mask) == level
    inner = _unwrapped(mask, level) if batched else mask.unsqueeze(0)
    per_member = inner.reshape(inner.shape[0], *[1] * (5 - inner.dim()), *inner.shape[1:])
    if per_member.shape[0] == 1 and per_member.shape[1] == 1:
        return per_member[0]
    return per_member.expand(members, batch, *per_member.shape[2:]).flatten(0, 1)
