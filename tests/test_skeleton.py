"""Skeletons: a pack's modules travel to workers without their weights."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import torch
from torch import fx, nn
from torch.nn.utils import parametrizations, parametrize

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.reparametrize import bind
from harmony.runtime.skeleton import dump_skeleton, load_skeleton, operator_modules


@torch.library.custom_op("harmony_tests::scaled", mutates_args=())
def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """A custom operator, as transformers registers one for a mixture of experts' grouped matrix product."""
    return x * factor


@scaled.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


class Scaling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.harmony_tests.scaled(self.linear(x), 2.0)


def test_skeleton_carries_structure_without_weights() -> None:
    module = nn.Sequential(nn.Linear(1000, 1000), nn.BatchNorm1d(1000))
    data = dump_skeleton(module)
    assert len(data) < 20_000
    skeleton = load_skeleton(data)
    assert skeleton[0].weight.device.type == "meta"
    params = {k: v.detach() for k, v in module.state_dict().items()}
    x = torch.randn(4, 1000)
    out = torch.func.functional_call(skeleton, params, (x,))
    torch.testing.assert_close(out, module(x))


def test_a_parametrized_module_travels_as_its_class_and_state_and_computes_as_it_does() -> None:
    """torch refuses to pickle a module with a parametrization (weight_norm, spectral_norm): its skeleton is its
    class and state, parametrized again where it is loaded, and computes from the given originals."""
    torch.manual_seed(0)
    module = nn.Sequential(parametrizations.weight_norm(nn.Linear(6, 6)), nn.Tanh(),
                           parametrizations.spectral_norm(nn.Linear(6, 3))).eval()
    skeleton = load_skeleton(dump_skeleton(module))
    assert all(parametrize.is_parametrized(layer, "weight") for layer in (skeleton[0], skeleton[2]))
    assert type(skeleton[0]).__name__ == "ParametrizedLinear" and isinstance(skeleton[0], nn.Linear)
    assert skeleton[0].parametrizations.weight.original0.device.type == "meta"
    tensors = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    assert {name for name, _ in skeleton.named_parameters()} | {name for name, _ in skeleton.named_buffers()} \
        == set(tensors)
    x = torch.randn(4, 6)
    torch.testing.assert_close(bind(skeleton.eval())(tensors, x), module(x), rtol=0, atol=0)
    load_skeleton(dump_skeleton(skeleton))  # and again, from where it landed


LOAD_AND_CALL = """
import sys, torch
from harmony.runtime.skeleton import load_skeleton
stage = load_skeleton(sys.stdin.buffer.read())
ones = {name: torch.ones(tensor.shape) for name, tensor in stage.state_dict().items()}
print(torch.func.functional_call(stage, ones, (torch.ones(1, 4),)).tolist())
"""


def test_a_traced_stage_that_calls_a_custom_operator_imports_its_module_where_it_lands() -> None:
    """A fresh interpreter (a worker) that never imported the module registering the operator rebuilds the stage
    and computes with it: the module is imported first (without, the rebuild's trace fails: no such operator)."""
    traced = fx.symbolic_trace(Scaling())
    assert operator_modules(traced.graph) == (scaled._init_fn.__module__,)
    assert operator_modules(fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU())).graph) == ()
    paths = os.pathsep.join(path for path in sys.path if path)
    done = subprocess.run([sys.executable, "-c", LOAD_AND_CALL], input=dump_skeleton(traced), capture_output=True,
                          env={**os.environ, "PYTHONPATH": paths}, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip() == "[[10.0, 10.0, 10.0, 10.0]]"


DEFINE_AND_DUMP = """
import pickle, sys, torch
from torch import fx, nn
from harmony.runtime.skeleton import dump_skeleton

@torch.library.custom_op("harmony_script::halved", mutates_args=())
def halved(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5

@halved.register_fake
def _(x):
    return torch.empty_like(x)

def backward(ctx, grad):
    return halved(grad) * 3  # not halved's true gradient: it shows the rule travelled

halved.register_autograd(backward)

class ByObject(nn.Module):
    def forward(self, x):
        return halved(x)

class ByName(nn.Module):
    def forward(self, x):
        return torch.ops.harmony_script.halved(x)

modules = [ByObject(), ByName(), fx.symbolic_trace(ByName())]
sys.stdout.buffer.write(pickle.dumps([dump_skeleton(module) for module in modules]))
"""

LOAD_AND_BACKPROPAGATE = """
import pickle, sys, torch
from harmony.runtime.skeleton import load_skeleton
for data in pickle.loads(sys.stdin.buffer.read()):
    x = torch.ones(2, requires_grad=True)
    load_skeleton(data)(x).sum().backward()
    print(x.grad.tolist())
"""


def test_a_custom_operator_defined_in_the_users_script_travels_with_the_skeleton_and_its_rules() -> None:
    """An operator registered in a script's __main__, which no worker can import, is registered where the skeleton
    lands, with its fake and autograd rules, whether the module calls it as the object, by name (torch.ops) or from a
    traced graph; without, the skeleton did not even pickle (torch's dispatch module inside the operator)."""
    paths = os.pathsep.join(path for path in sys.path if path)
    environment = {**os.environ, "PYTHONPATH": paths}
    dumped = subprocess.run([sys.executable, "-c", DEFINE_AND_DUMP], capture_output=True, env=environment,
                            timeout=120)
    assert dumped.returncode == 0, dumped.stderr.decode()[-2000:]
    done = subprocess.run([sys.executable, "-c", LOAD_AND_BACKPROPAGATE], input=dumped.stdout, capture_output=True,
                          env=environment, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split("\n")[:3] == ["[1.5, 1.5]"] * 3


REDEFINED = """
import sys, torch
from torch import nn
from harmony.runtime.skeleton import dump_skeleton

@torch.library.custom_op("harmony_script::times", mutates_args=())
def times(x: torch.Tensor) -> torch.Tensor:
    return x * FACTOR

class Times(nn.Module):
    def forward(self, x):
        return torch.ops.harmony_script.times(x)

sys.stdout.buffer.write(dump_skeleton(Times()))
"""

LOAD_IN_TURN = """
import pickle, sys, torch
from harmony.runtime.skeleton import load_skeleton
for data in pickle.loads(sys.stdin.buffer.read()):
    print(load_skeleton(data)(torch.ones(1)).item())
"""


def test_an_operator_shipped_again_with_another_definition_replaces_the_one_shipped_before() -> None:
    """A long-lived worker that registered a script's operator registers it again when the script, edited, ships
    another definition under the same name; the same definition shipped again is kept."""
    paths = os.pathsep.join(path for path in sys.path if path)
    environment = {**os.environ, "PYTHONPATH": paths}
    dumps = []
    for factor in ("2", "3"):
        dumped = subprocess.run([sys.executable, "-c", REDEFINED.replace("FACTOR", factor)], capture_output=True,
                                env=environment, timeout=120)
        assert dumped.returncode == 0, dumped.stderr.decode()[-2000:]
        dumps.append(dumped.stdout)
    done = subprocess.run([sys.executable, "-c", LOAD_IN_TURN], input=pickle.dumps([dumps[0], dumps[0], dumps[1]]),
                          capture_output=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split() == ["2.0", "2.0", "3.0"]


UNPICKLABLE = """
import logging, sys, threading, torch
from torch import nn
from harmony.runtime.skeleton import dump_skeleton, load_skeleton

logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
LOCK = threading.Lock()

@torch.library.custom_op("harmony_script::locked", mutates_args=())
def locked(x: torch.Tensor) -> torch.Tensor:
    with LOCK:
        return x.clone()

@torch.library.custom_op("harmony_script::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2

data = dump_skeleton(nn.Sequential(nn.Linear(2, 2)))
dump_skeleton(nn.Sequential(nn.Linear(2, 2)))
print("DUMPED", len(data) > 0, b"doubled" in data, b"locked" in data)
"""


def test_an_operator_of_the_script_that_cannot_be_pickled_stays_behind_with_a_warning() -> None:
    """An operator whose function holds what cannot be pickled (a lock) does not stop a run whose code never calls
    it: it is left out, with one warning that names it, and the other operators still travel."""
    paths = os.pathsep.join(path for path in sys.path if path)
    done = subprocess.run([sys.executable, "-c", UNPICKLABLE], capture_output=True,
                          env={**os.environ, "PYTHONPATH": paths}, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    lines = done.stdout.decode().splitlines()
    warnings = [line for line in lines if "harmony_script::locked" in line]
    assert len(warnings) == 1 and "cannot be sent to the workers" in warnings[0], lines
    assert "DUMPED True True False" in lines, lines
