"""Checkpoints of a run on disk: what a run resumes from, and plain state dicts a user loads without Harmony.

A job is checkpointed at the end of a span whose last step crosses a multiple of checkpoint_every, and at the
end of the run, from its host store version of that step (which no update overwrites before the driver has
written it: the driver writes it before it opens the job's next spans). Its directory holds:

  run.msgpack                  what the run is (its arguments' fingerprint) and its plan, written once;
  job-<j>/latest               the name of the job's newest complete checkpoint, replaced atomically;
  job-<j>/v<step>/             that checkpoint: per pack its weights, its optimizer state (layout, bytes,
                               description), the members' divergence and pruning steps, the loss history (and a clipped
                               job's gradient norms), and per member
                               model model-<i>.pt: torch.save({"model": state_dict, "optimizer": state_dict,
                               "step", "history"}, and with fp16 "scaler": a torch.amp.GradScaler state dict), the
                               state dicts of the user's module and of the user's
                               optimizer factory over its parameters. Written into a temporary directory first
                               and renamed, so that a process killed while writing leaves the previous one whole;
  model-<i>.pt                 a link to the model's newest model-<i>.pt, replaced atomically after latest (and
                               again when a run resumes: its driver may have been killed in between).

Resuming reads each job's latest checkpoint back into the new run's host store; the run refuses a checkpoint
whose fingerprint is not its own. A run that begins on the directory removes what drivers now gone were writing.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import msgpack
import psutil
import torch
from torch import nn

from harmony.runtime.array import member_layout
from harmony.runtime.array_optimizer import build_optimizer, param_origins
from harmony.runtime.code import JobCode, named_state
from harmony.runtime.divergence import TRAINING
from harmony.runtime.files import (
    LOSS_BLOCK,
    RunFiles,
    diverged_name,
    grad_norms_name,
    losses_name,
    optimizer_layout_name,
    optimizer_meta_name,
    optimizer_name,
    pruned_name,
    record_rows,
)
from harmony.runtime.hoststore import tensors_at
from harmony.runtime.optimstate import OptimizerState
from harmony.runtime.schedule import at_step
from harmony.tasks.runplan import RunPlan

RUN = "run.msgpack"
LATEST = "latest"


def replace_file(path: Path, data: bytes) -> None:
    """Write a file whole or not at all (a temporary beside it, flushed, then renamed over it)."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(scratch, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(scratch, path)


class Checkpoints:
    """A run's checkpoint directory, written by the driver from the run's host store."""

    def __init__(self, directory: Path, every: int | None, fingerprint: str) -> None:
        self.directory = directory
        self.every = every
        self.fingerprint = fingerprint

    def recorded(self) -> RunPlan | None:
        """The plan of the run this directory checkpoints, if any; a ValueError if it is another run's."""
        raw = (self.directory / RUN).read_bytes() if (self.directory / RUN).exists() else None
        if raw is None:
            return None
        record = msgpack.unpackb(raw)
        if record["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"the checkpoint in {self.directory} is of another run ({record['what']}); resume it with the same "
                "models, loaders and arguments, or use another checkpoint_dir"
            )
        return RunPlan.from_msgpack(record["plan"])

    def begin(self, plan: RunPlan, what: str) -> None:
        """Record the run (once: a resumed run keeps the record it resumes), and remove what a killed driver was
        writing."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._sweep()
        if not (self.directory / RUN).exists():
            record = {"fingerprint": self.fingerprint, "what": what, "plan": plan.to_msgpack()}
            replace_file(self.directory / RUN, msgpack.packb(record))

    def _sweep(self) -> None:
        """Remove the scratch of drivers that are gone: a checkpoint, latest or link being written, named
        .<name>.<pid>.tmp (see save and replace_file)."""
        for scratch in [*self.directory.glob(".*.tmp"), *self.directory.glob("job-*/.*.tmp")]:
            pid = scratch.name.split(".")[-2]
            if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
                if scratch.is_dir() and not scratch.is_symlink():
                    shutil.rmtree(scratch, ignore_errors=True)
                else:
                    scratch.unlink(missing_ok=True)

    def version(self, job: int) -> int:
        """The step of the job's newest complete checkpoint (0 with none)."""
        folder = self.latest(job)
        return 0 if folder is None else int(folder.name.removeprefix("v"))

    def latest(self, job: int) -> Path | None:
        """The job's newest complete checkpoint directory."""
        pointer = self.directory / f"job-{job}" / LATEST
        if not pointer.exists():
            return None
        return self.directory / f"job-{job}" / pointer.read_text().strip()

    def save(self, job: int, version: int, files: RunFiles, codes: list[JobCode], models: list[nn.Module],
             factories: list[Any]) -> bool:
        """Checkpoint a job at a step (version) it has completed, while at most one span has run past it; False
        (none written) when the job's machine is out of reach."""
        if not files.pull(job):
            return False
        folder = self.directory / f"job-{job}"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        final = folder / f"v{version}"
        scratch = folder / f".v{version}.{os.getpid()}.tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(mode=0o700)
        scaler = self._write_native(scratch, job, files, version)
        self._write_plain(scratch, job, files, codes, models, factories, version, scaler)
        if final.exists():
            shutil.rmtree(final)
        os.replace(scratch, final)
        replace_file(folder / LATEST, final.name.encode())
        self._settle(final, files.plan.jobs[job].members)
        return True

    def _settle(self, final: Path, members: tuple[int, ...]) -> None:
        """Point each member's model-<i>.pt at the job's latest checkpoint final and remove the job's older ones;
        also done on resume, since a driver killed after replacing latest leaves both undone."""
        for model in members:
            link = self.directory / f"model-{model}.pt"
            temporary = link.with_name(f".{link.name}.{os.getpid()}.tmp")
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(final.relative_to(self.directory) / link.name)
            os.replace(temporary, link)
        for old in final.parent.glob("v*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def _write_native(self, folder: Path, job: int, files: RunFiles, version: int) -> tuple[float, int] | None:
        """The job's own files of the checkpoint; returns the loss scaler's state at version (fp16), read once for
        both files: a homed job's next flushes may replace it while the checkpoint is written."""
        store, runtime = files.store(job), files.models[job]
        versions = files.versions(job)
        described: dict[str, Any] = {"version": version, "packs": []}
        for pack in range(len(runtime.packs)):
            slot = versions.slot(pack, version)
            (folder / f"p{pack}-weights.bin").write_bytes(files.weights(job, pack, slot).numpy().tobytes())
            state = OptimizerState(store, job, pack)
            tensors = state.tensors(slot)
            entry: dict[str, Any] = {"state": bool(tensors)}
            if tensors:
                layout = state.layout
                assert layout is not None
                buffer = store.attach(optimizer_name(job, pack, slot), layout.nbytes)
                (folder / f"p{pack}-optim.bin").write_bytes(buffer.numpy().tobytes())
                entry["layout"] = store.read_bytes(optimizer_layout_name(job, pack))
                entry["meta"] = store.read_bytes(optimizer_meta_name(job, pack, slot))
            described["packs"].append(entry)
        members = runtime.members
        stopped = store.attach(diverged_name(job), 8 * members).view(torch.float64)
        described["diverged"] = [step if step < version else TRAINING for step in stopped.tolist()]  # the span after
        pruned = store.attach(pruned_name(job), 8 * members).view(torch.float64)
        described["pruned"] = [step if step <= version else TRAINING for step in pruned.tolist()]
        described["history"] = files.history(job, version)
        if files.plan.jobs[job].clip:
            described["grad_norms"] = files.grad_norms(job, version)
        scaler = files.scaler(job).state(version) if files.plan.jobs[job].scaled else None
        if scaler is not None:
            described["scaler"] = list(scaler)
        replace_file(folder / "checkpoint.msgpack", msgpack.packb(described))
        return scaler

    def restore(self, job: int, files: RunFiles) -> int:
        """Put a job's latest checkpoint into the run's host store (as version v, in slot 0); returns v (0 with
        none)."""
        folder = self.latest(job)
        if folder is None:
            return 0
        self._settle(folder, files.plan.jobs[job].members)
        described = msgpack.unpackb((folder / "checkpoint.msgpack").read_bytes())
        version = int(described["version"])
        store, runtime = files.store(job), files.models[job]
        versions = files.versions(job)
        for pack, entry in enumerate(described["packs"]):
            files.weights(job, pack, 0).copy_(_bytes(folder / f"p{pack}-weights.bin"))
            if entry["state"]:
                store.write_bytes(optimizer_layout_name(job, pack), entry["layout"])
                layout_nbytes = msgpack.unpackb(entry["layout"])["nbytes"]
                for slot in (0, 1):
                    store.create(optimizer_name(job, pack, slot), layout_nbytes)
                store.attach(optimizer_name(job, pack, 0), layout_nbytes).copy_(_bytes(folder / f"p{pack}-optim.bin"))
                store.write_bytes(optimizer_meta_name(job, pack, 0), entry["meta"])
            versions.publish(pack, version, 0)
        stopped = store.attach(diverged_name(job), 8 * runtime.members).view(torch.float64)
        stopped.copy_(torch.tensor(described["diverged"], dtype=torch.float64))
        pruned = store.attach(pruned_name(job), 8 * runtime.members).view(torch.float64)
        pruned.copy_(torch.tensor(described.get("pruned", [TRAINING] * runtime.members), dtype=torch.float64))
        if "scaler" in described:
            scale, tracker = described["scaler"]
            files.scaler(job).reset(version, scale, tracker)
        for block in range(-(-version // LOSS_BLOCK)):
            files.open_step(job, block * LOSS_BLOCK)
        for key, name in (("history", losses_name), ("grad_norms", grad_norms_name)):
            if key in described:
                rows = torch.tensor(described[key], dtype=torch.float64).reshape(runtime.members, -1).T
                record_rows(store, lambda block, name=name: name(job, block), runtime.members, 0, rows)
        return version

    def _write_plain(self, folder: Path, job: int, files: RunFiles, codes: list[JobCode], models: list[nn.Module],
                     factories: list[Any], version: int, scaler: tuple[float, int] | None) -> None:
        """Per member model, its module's and its optimizer's state dicts at version, as torch.save writes them."""
        plan_job, code, runtime = files.plan.jobs[job], codes[job], files.models[job]
        versions = files.versions(job)
        with torch.no_grad():
            for pack in range(len(runtime.packs)):
                state = named_state(code.pack_module(plan_job.packing, pack))
                host = files.weights(job, pack, versions.slot(pack, version))
                for name, view in tensors_at(host, runtime.packs[pack].weights).items():
                    state[name].copy_(view)
            code.copy_back()
        history = files.history(job, version)
        for position, model_index in enumerate(plan_job.members):
            model = models[model_index]
            optimizer = self._plain_optimizer(job, files, code, model, factories[model_index], position, version)
            record = {
                "model": model.state_dict(),
                "optimizer": None if optimizer is None else optimizer.state_dict(),
                "step": version,
                "history": history[position],
            }
            if scaler is not None:
                record["scaler"] = files.settings.state_dict(*scaler)
            torch.save(record, folder / f"model-{model_index}.pt")

    def _plain_optimizer(self, job: int, files: RunFiles, code: JobCode, model: nn.Module, factory: Any,
                         position: int, version: int) -> torch.optim.Optimizer | None:
        """The user's optimizer over the user's model, holding the state Harmony's optimizers have at version (and,
        on a schedule, the learning rate of the update that follows, with initial_lr: as LambdaLR leaves it)."""
        if factory is None:
            return None
        optimizer = factory(list(model.parameters()))
        at_step(optimizer, version)
        user = {id(tensor): tensor for tensor in model.parameters()}
        plan_job, runtime = files.plan.jobs[job], files.models[job]
        versions = files.versions(job)
        for pack, pack_runtime in enumerate(runtime.packs):
            names = [slot.spec.name for slot in pack_runtime.stepped]  # as its optimizer was built (optimizer.py)
            if not names:
                continue
            saved = OptimizerState(files.store(job), job, pack)
            tensors = saved.tensors(versions.slot(pack, version))
            if not tensors:
                continue
            ghosts = [nn.Parameter(torch.empty(slot.spec.shape, device="meta", dtype=getattr(torch, slot.spec.dtype)))
                      for slot in pack_runtime.stepped]
            built = build_optimizer(code.optimizer, ghosts, names)  # type: ignore[arg-type]
            origins = param_origins(built, ghosts, names)
            owners = self._owners(code, plan_job.packing, pack, position)
            for (index, key), tensor in zip(saved.entries, tensors):
                member, name = origins[index]
                if member is not None and member != position:
                    continue  # another member's slice, in a merged array optimizer
                stacked = member is None and len(plan_job.members) > 1 and tensor.dim() > 0
                if stacked and key == "step":  # a stacked Adam's count is per member
                    value = tensor[position]
                else:
                    value = member_layout(name, tensor)[position] if stacked else tensor
                param = user.get(id(owners[name]))
                if param is not None:
                    optimizer.state[param][key] = value.clone()
        return optimizer

    @staticmethod
    def _owners(code: JobCode, packing: Any, pack: int, position: int) -> dict[str, torch.Tensor]:
        """Per tensor name of a pack, the user's tensor it stands for (for an array, the member's)."""
        module = code.pack_module(packing, pack)
        if len(code.member_layers) <= 1:
            return named_state(module)
        spec = packing.packs[pack]
        member = nn.Sequential(*code.member_layers[position][spec.first : spec.stop])
        owners = {}
        for offset, layer in enumerate(module):
            for name, tensor in named_state(member[offset]).items():
                owners[f"{offset}.{layer.attribute(name)}"] = tensor
        return owners


def _bytes(path: Path) -> torch.Tensor:
    """A file's bytes as a uint8 tensor; an empty file's (a pack without weights, an ReLU alone) is empty."""
    data = bytearray(path.read_bytes())
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def fingerprint(parts: dict[str, Any]) -> str:
    """A stable text of what makes a run itself (its models, data and arguments), to compare a resume with."""
    return json.dumps(parts, sort_keys=True, default=str)
