"""Loss scaling for precision="fp16", as torch.amp.GradScaler does it, for a model updated pack by pack.

A plain loop scales the loss by the step's scale, unscales every gradient, skips the optimizer's step when any
gradient is not finite, and updates the scale (backing off after a skipped step, growing after growth_interval
good ones). Here the packs of a swapped model are updated one by one, on any worker of the machine, so what the
whole model's step decides lives in the host store:

  scaler    two slots of (step, scale, growth tracker), float64: the state the step in it runs with. The
            update of the model's last pack writes step s + 1's into the slot not holding step s (from step
            s's state and its flags, so an update run again writes the same), and a homed model's flush writes
            its next version's there, so a worker that dies in the middle leaves the current state whole;
  found     per step parity, pack and micro-batch group, whether that pack's gradients held a value that is not
            finite (written by its bwd); every upd of a step waits for every bwd of it (tasks.graph), so each
            pack's update knows whether the model's step is skipped.

Unscaling is out of place (the gradients times the inverse scale into the reduced gradients file, which the
optimizer reads), with torch's own kernels, so that an update run again unscales the same gradients and the
result is bit for bit a plain GradScaler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.tasks.layout import BufferLayout

SCALER_BYTES = 2 * 3 * 8


def scaler_name(model: int) -> str:
    return f"m{model}-scaler"


def found_name(model: int) -> str:
    return f"m{model}-found"


def found_bytes(packs: int, groups: int) -> int:
    return 2 * packs * groups * 8


@dataclass(frozen=True)
class Settings:
    """torch.amp.GradScaler's arguments, with its defaults."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def state_dict(self, scale: float, tracker: int) -> dict[str, float | int]:
        """What torch.amp.GradScaler.state_dict() holds with this scale and growth tracker."""
        return {"scale": scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": tracker}


class Scaler:
    """One job's loss-scaling state in its host store (see the module)."""

    def __init__(self, store: HostStore, model: int, packs: int, groups: int, settings: Settings) -> None:
        self.settings = settings
        self.slots = store.attach(scaler_name(model), SCALER_BYTES).view(torch.float64).view(2, 3)
        self.flags = store.attach(found_name(model), found_bytes(packs, groups)).view(torch.float64).view(
            2, packs, groups)

    @staticmethod
    def create(store: HostStore, model: int, packs: int, groups: int, settings: Settings) -> None:
        """The job's files, holding a fresh run's state: the initial scale at step 0."""
        store.create(scaler_name(model), SCALER_BYTES)
        store.create(found_name(model), found_bytes(packs, groups)).zero_()
        Scaler(store, model, packs, groups, settings).reset(0, settings.init_scale, 0)

    def state(self, step: int) -> tuple[float, int]:
        """The scale and growth tracker step runs with."""
        for row in self.slots:
            if int(row[0]) == step:
                return float(row[1]), int(row[2])
        raise RuntimeError(f"the loss scale of step {step} is not in the host store (it holds steps "
                           f"{[int(row[0]) for row in self.slots]})")

    def holds(self, step: int) -> bool:
        """Whether step's state is written."""
        return any(int(row[0]) == step for row in self.slots)

    def save(self, step: int, scale: float, tracker: int, after: int) -> None:
        """Write step's state into the slot that does not hold the state of step after (the one it follows)."""
        held = [int(row[0]) for row in self.slots]
        if after not in held:
            raise RuntimeError(f"the loss scale of step {after} is not in the host store (it holds steps {held})")
        self.slots[1 - held.index(after)] = torch.tensor([step, scale, tracker], dtype=torch.float64)

    def reset(self, step: int, scale: float, tracker: int) -> None:
        """Hold step's state alone (a run resumed from a checkpoint of step)."""
        self.slots[0] = torch.tensor([step, scale, tracker], dtype=torch.float64)
        self.slots[1] = torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64)

    def flag(self, step: int, pack: int, group: int, found: bool) -> None:
        self.flags[step % 2, pack, group] = float(found)

    def found(self, step: int) -> bool:
        """Whether some gradient of step (any pack, any group) was not finite: the step is skipped."""
        return bool(self.flags[step % 2].any())

    def unscale(self, source: torch.Tensor, target: torch.Tensor, layout: BufferLayout, step: int) -> None:
        """target = source times the step's inverse scale, tensor by tensor (the gradients file's bytes)."""
        target.copy_(source)
        inverse = self.inverse(step)
        found = torch.zeros(1)
        tensors = [tensor for tensor in tensors_at(target, layout).values() if tensor.is_floating_point()]
        if tensors:
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inverse)

    def inverse(self, step: int) -> torch.Tensor:
        """What unscaling multiplies step's gradients by, as GradScaler computes it."""
        scale, _ = self.state(step)
        return torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()

    def advance(self, step: int) -> None:
        """Write the state step + 1 runs with: the scale backed off after a skipped step, grown after
        growth_interval good ones (torch's own update kernel)."""
        scale, tracker = self.state(step)
        scale_tensor = torch.tensor([scale], dtype=torch.float32)
        tracker_tensor = torch.tensor([tracker], dtype=torch.int32)
        found = torch.tensor([float(self.found(step))], dtype=torch.float32)
        torch._amp_update_scale_(scale_tensor, tracker_tensor, found, self.settings.growth_factor,
                                 self.settings.backoff_factor, self.settings.growth_interval)
        self.save(step + 1, float(scale_tensor), int(tracker_tensor), after=step)


def finite(grads: dict[str, torch.Tensor]) -> bool:
    """Whether every floating-point gradient is finite (one sync for them all)."""
    checks = [torch.isfinite(grad).all() for grad in grads.values() if grad.is_floating_point()]
    return bool(torch.stack(checks).all()) if checks else True
