"""The pilot pass: decomposition into chains, profiling, and leaving the model as it was."""

from __future__ import annotations

import weakref
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint

from harmony.runtime.pilot import Allocated, KeywordCall, decompose
from harmony.tasks.graph import TaskId
from harmony.tasks.hardware import Hardware
from harmony.tasks.packing import LayerTooLarge, cut_packs, workspace_bytes
from harmony.tasks.profile import BACKWARD_RATIO
from tests.conftest import MaskedSquares, ResidualBlock


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.mid = nn.Tanh()
        self.b = nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.mid(self.a(x)))


class CalledOutOfOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(8, 2)
        self.first = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class FunctionBetweenChildren(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 1e9:
            raise ValueError("never on the pilot batch")
        return self.a(x)


def test_children_are_taken_in_the_order_forward_calls_them() -> None:
    model = CalledOutOfOrder()
    result = decompose(model, torch.randn(3, 8), "m")
    assert result.layers == [model.first, model.second]


def test_a_forward_with_work_between_children_is_cut_at_them_the_work_going_with_the_child_before() -> None:
    model = FunctionBetweenChildren()
    x = torch.randn(3, 8)
    result = decompose(model, x, "m")
    assert result.notes == ["FunctionBetweenChildren: traced by torch.fx and cut into 2 stages at a, b; one value "
                            "crosses each cut"]
    assert [layer.harmony_description for layer in result.layers] == ["a", "b"]
    assert result.layers[0].a.weight is model.a.weight
    torch.testing.assert_close(result.output, model(x), rtol=0, atol=0)


def test_a_forward_with_data_dependent_branches_stays_whole_and_says_why() -> None:
    model = DataDependent()
    result = decompose(model, torch.randn(3, 8), "m")
    assert result.layers == [model]
    assert result.notes == [f"DataDependent: {result.notes[0].split(': ', 1)[1]}"]
    assert "not traceable by torch.fx" in result.notes[0]


def test_nested_sequentials_flatten_to_leaf_layers() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 4)))
    result = decompose(model, torch.randn(3, 8), "m")
    assert [type(layer).__name__ for layer in result.layers] == ["Linear", "ReLU", "Linear"]
    assert len(result.profile.layers) == 3


def test_a_module_that_calls_its_children_in_order_is_a_chain() -> None:
    result = decompose(Chain(), torch.randn(3, 8), "m")
    assert [type(layer).__name__ for layer in result.layers] == ["Linear", "ReLU", "Linear"]


def test_a_residual_block_stays_one_layer() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Residual(), nn.Linear(8, 2))
    result = decompose(model, torch.randn(3, 8), "m")
    assert [type(layer).__name__ for layer in result.layers] == ["Linear", "Residual", "Linear"]


def test_a_weight_two_layers_share_is_held_by_the_first_and_borrowed_by_the_later() -> None:
    result = decompose(Tied(), torch.randn(3, 8), "m")
    first, _, last = result.profile.layers
    assert [spec.name for spec in first.params] == ["weight"] and not first.borrowed
    assert not last.params and [spec.name for spec in last.borrowed] == ["weight"] and last.lenders == ((0, "weight"),)
    assert last.weight_bytes == last.grad_bytes == 8 * 8 * 4 and result.profile.weight_bytes == 8 * 8 * 4
    shared = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    model = nn.Sequential(shared, nn.Tanh(), shared)
    assert len(decompose(model, torch.randn(3, 8), "m").layers) == 1, "one layer from its first use to its last"


def test_a_module_a_sequential_holds_twice_runs_twice_in_the_chain() -> None:
    """A Sequential's entries as its forward runs them: named_children lists a module held twice once, and a chain
    built from it would skip the second use."""
    shared = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    model = nn.Sequential(nn.Linear(8, 8), shared, nn.Tanh(), shared, nn.Linear(8, 2))
    x = torch.randn(3, 8)
    result = decompose(model, x, "m")
    assert len(result.layers) == 3, "the first Linear, one layer from shared's first use to its last, the last Linear"
    with torch.no_grad():
        y = x
        for layer in result.layers:
            y = layer(y)
        assert torch.equal(y, model(x))


def test_profile_measures_bytes_per_sample() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    profile = decompose(model, torch.randn(4, 8), "m").profile
    first = profile.layers[0]
    assert first.param_bytes == (8 * 16 + 16) * 4
    assert first.input_bytes_per_sample == 8 * 4
    assert first.output_bytes_per_sample == 16 * 4
    assert profile.pilot_samples == 4


def test_pilot_leaves_buffers_and_rng_untouched() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(4, 8)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    decompose(model, sample, "m")
    assert torch.equal(torch.rand(3), expected_draw)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class SometimesDraws(nn.Module):
    """Draws from the random generator only in training mode, through a function, not a dropout module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x) if self.training else x


def test_the_pilot_marks_the_layers_that_draw_random_numbers() -> None:
    """A layer draws when its forward moved the generator (a dropout module, or a draw of its own), and only in the
    mode it is trained in; the generator itself is left as it was found."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU(), SometimesDraws(), nn.Dropout(0.0),
                          nn.Linear(8, 2))
    sample = torch.randn(4, 8)
    generator = torch.get_rng_state()
    assert [layer.draws for layer in decompose(model, sample, "m").profile.layers] == [
        False, True, False, True, False, False]
    assert torch.equal(torch.get_rng_state(), generator)
    model.eval()
    assert not any(layer.draws for layer in decompose(model, sample, "m").profile.layers)


class Watched(nn.Module):
    """A layer that records, at each call, how many of its earlier outputs are still held (its data-dependent branch
    keeps torch.fx from tracing into it: it is one layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.outputs: list[weakref.ref] = []
        self.held: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.held.append(sum(ref() is not None for ref in self.outputs))
        y = self.fc(x) if x.sum() > -1e9 else x
        self.outputs.append(weakref.ref(y))
        return y


def test_the_pilot_holds_one_output_of_a_layer_at_a_time_and_goes_on_from_its_last_call() -> None:
    """A sub-array's outputs or a language model's logits can be most of the pilot's memory: no call may start while
    an earlier call's output is held, and the chain goes on from the last call's output (no extra forward)."""
    watched = Watched()
    model = nn.Sequential(watched, nn.ReLU(), nn.Linear(8, 2))
    decomposition = decompose(model, torch.randn(4, 8), "m", repeats=5)
    assert len(watched.held) >= 5 and max(watched.held) == 0, watched.held  # the tracer calls it too
    assert decomposition.output.shape == (4, 2)


def test_a_model_of_an_architecture_piloted_before_calls_each_layer_once_and_takes_its_timings(
    timed_calls: list[int]
) -> None:
    repeats = timed_calls
    model = lambda outputs=2: nn.Sequential(Watched(), nn.ReLU(), nn.Linear(8, outputs))  # noqa: E731
    sample = torch.randn(4, 8)
    timed = decompose(model(), sample, "m0", repeats=5).profile
    profile = decompose(model(), sample, "m1", repeats=5, timed=timed).profile
    assert repeats == [5] * 3 + [1] * 3
    assert [layer.forward_seconds_per_sample for layer in profile.layers] == [
        layer.forward_seconds_per_sample for layer in timed.layers]
    assert [layer.output_bytes_per_sample for layer in profile.layers] == [
        layer.output_bytes_per_sample for layer in timed.layers]
    repeats.clear()
    decompose(model(outputs=3), sample, "m2", repeats=5, timed=timed)  # another architecture
    decompose(model(), sample[:2], "m3", repeats=5, timed=timed)  # other samples
    assert repeats == [5] * 6, "each is timed on its own"


def test_a_block_in_a_sequential_stays_whole_unless_its_weights_exceed_the_limit() -> None:
    blocks = nn.Sequential(ResidualBlock(8), ResidualBlock(8), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    whole = decompose(blocks, x, "m", largest=10**6)
    assert [type(layer).__name__ for layer in whole.layers] == ["ResidualBlock", "ResidualBlock", "Linear"]
    assert not whole.notes
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    cut = decompose(blocks, x, "m", largest=block_bytes - 1)
    assert len(cut.layers) == 7 and cut.notes[0].startswith("ResidualBlock: traced by torch.fx and cut into 3 stages")
    torch.testing.assert_close(cut.output, blocks(x), rtol=0, atol=0)


def test_under_autocast_the_linears_are_halved_and_a_tied_weight_is_not() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8))
    model[3].weight = model[0].weight  # read by two layers: another could read it otherwise than autocast casts
    result = decompose(model, torch.randn(3, 8), "m", autocast="bfloat16")
    assert [set(layer.halved) for layer in result.profile.layers] == [{"bias"}, set(), {"weight", "bias"}, {"bias"}]
    assert [layer.halved_bytes for layer in result.profile.layers] == [32, 0, 288, 32]
    assert all(not layer.halved for layer in decompose(model, torch.randn(3, 8), "m").profile.layers)


class Clocked(nn.Module):
    """An identity layer that takes cost seconds of a fake clock when it was the last layer called, and twice that
    when another was: its weights and input still in the caches, or not."""

    def __init__(self, clock: SimpleNamespace, cost: float) -> None:
        super().__init__()
        self.clock = clock
        self.cost = cost
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.cost if self.clock.last is self else 2 * self.cost
        self.clock.last = self
        return x * self.weight


def test_the_layers_times_add_up_to_a_forward_through_the_whole_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer timed alone finds the caches warm; the chain does not. The layers' fastest times (0.5 and 1 s) are
    scaled to the chain's forward (1 + 2 s), each keeping its share."""
    from harmony.runtime import pilot

    clock = SimpleNamespace(now=0.0, last=None)
    monkeypatch.setattr(pilot, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    sample = torch.randn(4, 8)
    profile = decompose(nn.Sequential(Clocked(clock, 0.5), Clocked(clock, 1.0)), sample, "m", repeats=3).profile
    assert [layer.forward_seconds_per_sample * 4 for layer in profile.layers] == [1.0, 2.0]


class Autocasting(nn.Module):
    """An identity layer that takes cost seconds of a fake clock, speedup times less under CPU autocast."""

    def __init__(self, clock: SimpleNamespace, cost: float, speedup: float) -> None:
        super().__init__()
        self.clock = clock
        self.cost = cost
        self.speedup = speedup
        self.backward_cost = 2.25
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.cost / self.speedup if torch.is_autocast_enabled("cpu") else self.cost
        return Backward.apply(x * self.weight, self)


def test_under_autocast_layers_are_timed_as_the_run_computes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 run's layers are timed under autocast, where they may compute faster or not, alone and chained (the
    first layer here gains from it, the second not); the output a loss is checked on is still the
    model's own, in float32."""
    from harmony.runtime import pilot

    clock = SimpleNamespace(now=0.0, first_backward=0.0)
    monkeypatch.setattr(pilot, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(pilot, "BACKWARD_SECONDS", 100.0)
    model = nn.Sequential(Autocasting(clock, 1.0, 4.0), Autocasting(clock, 2.0, 1.0), nn.Linear(8, 2))
    for autocast, seconds, ratio in ((None, [1.0, 2.0], 1.5), ("bfloat16", [0.25, 2.0], 2.0)):
        decomposition = decompose(model, torch.randn(4, 8), "m", repeats=3, autocast=autocast)
        assert [layer.forward_seconds_per_sample * 4 for layer in decomposition.profile.layers[:2]] == seconds
        assert decomposition.profile.backward_ratio == ratio, "a backward of 4.5 s per the chain's forward"
        assert decomposition.output.dtype == torch.float32


def test_a_model_that_is_one_layer_is_not_timed_again_as_a_chain() -> None:
    """A chain of one layer (a model that fits a pack whole, a sweep's trial array) is the layer its timed calls
    measured: a forward through it would take as long again for nothing (a GPT-2 array's forward takes seconds)."""
    layer = nn.Linear(8, 2)
    calls = []
    layer.register_forward_hook(lambda *_: calls.append(1) if not torch.is_grad_enabled() else None)
    decompose(layer, torch.randn(4, 8), "m", repeats=5)
    assert len(calls) == 5
    calls.clear()
    decompose(nn.Sequential(layer, nn.ReLU()), torch.randn(4, 8), "m", repeats=5)
    assert len(calls) == 5 + 2, "a chain of several layers is timed through once more, twice"


class Backward(torch.autograd.Function):
    """The identity, whose backward takes the layer's backward seconds of its clock (first_backward more the first
    time: an op's first backward in a process)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        layer = ctx.layer
        layer.clock.now += layer.backward_cost + layer.clock.first_backward
        layer.clock.first_backward = 0.0
        layer.clock.backwards = getattr(layer.clock, "backwards", 0) + 1
        return grad, None


class TimedBoth(Clocked):
    """A Clocked layer whose backward takes backward_cost seconds of the clock."""

    def __init__(self, clock: SimpleNamespace, cost: float, backward_cost: float) -> None:
        super().__init__(clock, cost)
        self.backward_cost = backward_cost

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Backward.apply(super().forward(x), self)


def test_the_backward_is_timed_through_the_chain_after_a_round_that_warms_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's forward takes 0.5 + 1 s (each layer called after the other: twice its cost) and its backward
    1.5 + 4.5 s: a backward of three forwards, which the simulator then predicts; the first backward's 100 s more
    fall in a backward that is not timed (measuring what a layer keeps, or the round on two samples). The
    parameters' gradients are as they were. A model piloted again runs only the backward of each layer that
    measures what it keeps."""
    from harmony.runtime import pilot
    from harmony.tasks.work import task_seconds

    clock = SimpleNamespace(now=0.0, last=None, first_backward=100.0)
    monkeypatch.setattr(pilot, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(pilot, "BACKWARD_SECONDS", 100.0)
    model = nn.Sequential(TimedBoth(clock, 0.25, 1.5), TimedBoth(clock, 0.5, 4.5))
    kept = torch.full((1,), 7.0)
    model[0].weight.grad = kept
    profile = decompose(model, torch.randn(4, 8), "m", repeats=3).profile
    assert profile.backward_ratio == 4.0
    assert model[0].weight.grad is kept and model[1].weight.grad is None
    packing = cut_packs(profile, 10**6, 4)
    forward = sum(layer.forward_seconds_per_sample for layer in profile.layers) * 4
    bwd = task_seconds(TaskId("bwd", 0, 0, 0), packing, 4, Hardware())
    assert bwd == pytest.approx(forward * (1 + 4.0))

    assert clock.backwards > 2
    clock.backwards = 0
    again = decompose(nn.Sequential(TimedBoth(clock, 0.25, 9.0), TimedBoth(clock, 0.5, 9.0)), torch.randn(4, 8), "m",
                      timed=profile).profile
    assert again.backward_ratio == 4.0 and clock.backwards == 2, "a profile timed before is not timed again"


class Recorded(TimedBoth):
    """A TimedBoth layer whose forward takes recording seconds more where autograd records it."""

    def __init__(self, clock: SimpleNamespace, cost: float, backward_cost: float, recording: float) -> None:
        super().__init__(clock, cost, backward_cost)
        self.recording = recording

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.clock.now += self.recording
        return super().forward(x)


def test_the_backward_ratio_counts_what_recording_the_graph_adds_to_the_recompute(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's forward takes 0.5 + 1 s under no_grad, as the profiles time it, and 0.5 s more recording the
    graph, as a backward's recompute runs it; its backward 1.5 + 4.5 s. A bwd task is the recompute and the
    backward, 8 s: the profiles' 1.5 s forward times one and the ratio. Timed on fewer samples than the pilot's
    micro-batch (whose no_grad forward the profiles do not give), the recording forward is the unit instead."""
    from harmony.runtime import pilot
    from harmony.tasks.work import task_seconds

    clock = SimpleNamespace(now=0.0, last=None, first_backward=0.0)
    monkeypatch.setattr(pilot, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(pilot, "BACKWARD_SECONDS", 100.0)
    model = nn.Sequential(Recorded(clock, 0.25, 1.5, 0.1), Recorded(clock, 0.5, 4.5, 0.4))
    profile = decompose(model, torch.randn(4, 8), "m", repeats=3).profile
    assert sum(layer.forward_seconds_per_sample for layer in profile.layers) * 4 == pytest.approx(1.5)
    assert profile.backward_ratio == pytest.approx((0.5 + 6.0) / 1.5)
    bwd = task_seconds(TaskId("bwd", 0, 0, 0), cut_packs(profile, 10**6, 4), 4, Hardware())
    assert bwd == pytest.approx(1.5 + 0.5 + 6.0)
    monkeypatch.setattr(pilot, "BACKWARD_SECONDS", 0.6)  # the rounds on 2 samples of the 8
    fewer = decompose(model, torch.randn(8, 8), "m", repeats=3).profile
    assert fewer.backward_ratio == pytest.approx(6.0 / 2.0)


def test_a_backward_is_two_forwards_where_it_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to train, or more activations to keep than BACKWARD_BYTES: the textbook count."""
    from harmony.runtime import pilot

    frozen = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).requires_grad_(False)
    assert decompose(frozen, torch.randn(4, 8), "m").profile.backward_ratio == BACKWARD_RATIO == 2.0
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    assert decompose(model, torch.randn(4, 8), "m").profile.backward_ratio != BACKWARD_RATIO
    monkeypatch.setattr(pilot, "BACKWARD_BYTES", 4 * (8 + 8 + 8) * 4 - 1)
    assert decompose(model, torch.randn(4, 8), "m").profile.backward_ratio == BACKWARD_RATIO


def test_a_chain_given_shares_is_timed_whole_and_split_as_they_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sub-array is timed through its whole chain (layers called after each other: 0.5 + 1 s here), each layer
    called once more for its output and sizes, and the time split as its member's layers split theirs (1 : 3)."""
    from harmony.runtime import pilot

    clock = SimpleNamespace(now=0.0, last=None)
    monkeypatch.setattr(pilot, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    member = decompose(nn.Sequential(Clocked(clock, 0.1), Clocked(clock, 0.3)), torch.randn(4, 8), "m").profile
    layers = nn.Sequential(Clocked(clock, 0.25), Clocked(clock, 0.5))
    calls: list[int] = []
    for layer in layers:
        layer.register_forward_hook(lambda *_: calls.append(1) if not torch.is_grad_enabled() else None)
    profile = decompose(layers, torch.randn(4, 8), "array", repeats=5, shares=member).profile
    assert [layer.forward_seconds_per_sample * 4 for layer in profile.layers] == pytest.approx([0.375, 1.125])
    assert len(calls) == 2 * (1 + 1), "each layer once, then through the chain (once: it takes over TIMING_BUDGET)"
    unlike = decompose(layers, torch.randn(4, 8), "array", repeats=5, shares=replace(member, layers=member.layers[:1]))
    assert [layer.forward_seconds_per_sample * 4 for layer in unlike.profile.layers] == [0.5, 1.0], "timed alone"
    one = decompose(nn.Sequential(Clocked(clock, 0.25)), torch.randn(4, 8), "array",
                    shares=replace(member, layers=member.layers[:1])).profile
    assert one.layers[0].forward_seconds_per_sample * 4 == 0.25, "a chain of one layer given shares: timed whole too"


def test_a_long_forwards_backward_is_timed_on_fewer_samples_or_not_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's forward takes 1.5 s for 8 samples: under BACKWARD_SECONDS of 0.6 the rounds take 3 of them (after
    the round on 2); under 0.3 not even 2 fit, and the backward is two forwards."""
    from harmony.runtime import pilot

    clock = SimpleNamespace(now=0.0, last=None, first_backward=0.0)
    monkeypatch.setattr(pilot, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    model = nn.Sequential(TimedBoth(clock, 0.25, 1.5), TimedBoth(clock, 0.5, 4.5))
    sizes: list[int] = []
    model[0].register_forward_hook(lambda _, inputs, __: sizes.append(len(inputs[0])) if torch.is_grad_enabled()
                                   else None)
    monkeypatch.setattr(pilot, "BACKWARD_SECONDS", 0.6)
    assert decompose(model, torch.randn(8, 8), "m", repeats=3).profile.backward_ratio == 4.0
    assert sizes == [8, 2, 3], "what the layer keeps, measured on the micro-batch, then the rounds on 2 and 3"
    sizes.clear()
    monkeypatch.setattr(pilot, "BACKWARD_SECONDS", 0.3)
    assert decompose(model, torch.randn(8, 8), "m", repeats=3).profile.backward_ratio == BACKWARD_RATIO
    assert sizes == [8]


def test_allocated_holds_the_most_bytes_ops_made_inside_it_held_at_once() -> None:
    """Freed tensors give their bytes back; a view and an op in place add none."""
    x = torch.zeros(256)
    with Allocated() as allocated:
        a = x + 1  # 1 KiB
        b = a * 2  # 2 KiB live
        del a
        c = b.view(16, 16).add_(1)  # a view, in place: nothing new
        d = torch.ones(512)  # 1 + 2 KiB live: the peak
        del b, c, d
        e = torch.ones(128)
    assert (allocated.peak, allocated.live) == (3072, 512)
    del e


class GeluBlock(nn.Module):
    """A block whose hidden activations (four times its width, GELU's tanh terms) are what its backward keeps."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x), approximate="tanh"))


class Checkpointed(nn.Module):
    """A block whose internals its backward recomputes (torch.utils.checkpoint): its forward keeps only its input."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


def _blocks() -> dict[str, tuple[nn.Module, Any]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=500, use_cache=False)
    ids = torch.randint(0, 500, (4, 64))
    checkpointed = transformers.GPT2LMHeadModel(config)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return {
        "gpt2": (KeywordCall(transformers.GPT2LMHeadModel(config)), {"input_ids": ids, "labels": ids}),
        "encoder": (nn.Sequential(*[nn.TransformerEncoderLayer(32, 4, 128, dropout=0.1, batch_first=True)
                                    for _ in range(2)]), torch.randn(4, 24, 32)),
        "gelu blocks": (nn.Sequential(*[GeluBlock(32) for _ in range(3)]), torch.randn(16, 32)),
        "conv blocks": (nn.Sequential(*[ConvBlock(8) for _ in range(2)]), torch.randn(4, 8, 16, 16)),
        "wide gelu blocks": (nn.Sequential(*[GeluBlock(128) for _ in range(3)]), torch.randn(2, 128)),
        "checkpointed gelu blocks": (nn.Sequential(*[Checkpointed(GeluBlock(32)) for _ in range(3)]),
                                     torch.randn(16, 32)),
        "checkpointed gpt2": (KeywordCall(checkpointed), {"input_ids": ids, "labels": ids}),
    }


@pytest.mark.parametrize("held", ["fp32", "bf16, halved", "bf16, float32"])
@pytest.mark.parametrize("name", ["gpt2", "encoder", "gelu blocks", "conv blocks", "wide gelu blocks",
                                  "checkpointed gelu blocks", "checkpointed gpt2"])
def test_a_packs_workspace_holds_what_its_recompute_and_backward_keep(name: str, held: str) -> None:
    """A block piloted as one layer keeps its internals for its backward (attention's probabilities, an MLP's hidden
    activations, dropout's masks): each pack's workspace, whole or cut, holds the most bytes its forward with autograd
    and its backward hold at once, beside its weights and their gradient buffer (measured op by op; docs/performance.md,
    "What a layer keeps for its backward"). Under bf16 autocast, with the halved weights on the device in
    bfloat16 (a swapped pack) or all of them in float32 (a homed model, a fused array: Pack.float_workspace), it also
    holds autocast's copies of the weights (wide blocks on two samples: the copies are most of it)."""
    model, sample = _blocks()[name]
    model.train()
    autocast = None if held == "fp32" else "bfloat16"
    finer = {"largest": 100_000, "export": True} if name == "gpt2" else {}  # its stages, as a swapped LM is cut
    decomposition = decompose(model, sample, name, autocast=autocast, **finer)
    profile = decomposition.profile
    samples = profile.pilot_samples
    assert any(layer.saved_bytes_per_sample > 0 or layer.transient_bytes_per_sample > 0 for layer in profile.layers), \
        "no layer keeps anything inside, or recomputes it"
    whole = cut_packs(profile, 1 << 40, samples)
    cuts = []
    for eighths in range(7, 0, -1):  # the tightest budget that still cuts it: packs of one layer where they must be
        try:
            cuts.append(cut_packs(profile, whole.packs[0].cost.total * eighths // 8, samples))
        except LayerTooLarge:
            break
    assert cuts or len(profile.layers) == 1, "a chain cut no finer than the whole"
    for packing in (whole, *cuts[-1:]):
        x = sample
        for pack in packing.packs:
            layers = decomposition.layers[pack.first : pack.stop]
            halved = [parameter for offset, layer in enumerate(layers) for name, parameter in layer.named_parameters()
                      if f"{offset}.{name}" in pack.halved and held == "bf16, halved"]
            floats = [parameter.data for parameter in halved]
            for parameter in halved:
                parameter.data = parameter.data.to(torch.bfloat16)
            peak = _held(layers, x, autocast is not None)
            workspace = pack.float_workspace if held == "bf16, float32" else pack.cost.workspace
            assert peak <= workspace, (name, pack.first, pack.stop, peak, workspace)
            for parameter, data in zip(halved, floats):
                parameter.data = data
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast is not None):
                for layer in layers:
                    x = layer(x)


def _held(layers: list[nn.Module], x: Any, autocast: bool = False) -> int:
    """The most bytes a forward with autograd (under bf16 autocast, with autocast) and a backward through layers hold
    at once, their input's among them, beside the weights' gradient buffers (charged apart from the workspace)."""
    for parameter in (parameter for layer in layers for parameter in layer.parameters()):
        parameter.grad = torch.zeros_like(parameter)
    with torch.enable_grad():
        inputs = tree_map(lambda leaf: leaf.detach().requires_grad_().clone()
                          if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf, x)
    allocated = Allocated()
    with allocated, torch.enable_grad():
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = inputs
            for layer in layers:
                y = layer(y)
        outputs = [leaf for leaf in tree_leaves(y) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(leaf) for leaf in outputs])
    for parameter in (parameter for layer in layers for parameter in layer.parameters()):
        parameter.grad = None
    return sum(leaf.nbytes for leaf in tree_leaves(inputs) if isinstance(leaf, torch.Tensor)) + allocated.peak


def test_what_a_layer_keeps_whatever_the_micro_batch_counts_once_at_every_size() -> None:
    """A spectral-normed Linear keeps its computed weight for its backward, and the backward through the power
    iteration's sigma allocates more than the activations: neither grows with the micro-batch. Piloted on 8 samples,
    the workspace holds what the model holds on 1 to 32 samples, where counted per sample it fell short below 8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), parametrizations.spectral_norm(nn.Linear(64, 64)), nn.Tanh(),
                          nn.Linear(64, 4))
    decomposition = decompose(model, torch.randn(8, 64), "m")
    normed = decomposition.profile.layers[2]
    assert normed.saved_bytes >= 64 * 64 * 4 and normed.saved_bytes_per_sample == 0
    assert normed.transient_bytes > 0 and normed.transient_bytes_per_sample == 0
    for samples in (1, 2, 8, 32):
        held = _held(decomposition.layers, torch.randn(samples, 64))
        assert held <= workspace_bytes(decomposition.profile.layers, samples), (samples, held)


class Numpied(nn.Module):
    """A first layer that reads its input through NumPy: it works on a batch, which never requires gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.numpy() * 2)


def test_what_a_layer_keeps_is_measured_from_an_input_that_requires_gradients_but_for_the_models_first() -> None:
    """As a bwd task's recompute runs them: the model's first layer reads the batch, later ones values that require
    gradients (x times tanh(x) keeps the tanh, made inside; the Linear keeps only its input and its weight)."""
    decomposition = decompose(nn.Sequential(Numpied(), Scaled(), nn.Linear(8, 2)), torch.randn(4, 8), "m")
    assert [layer.saved_bytes_per_sample for layer in decomposition.profile.layers] == [0, 8 * 4, 0]


class Scaled(nn.Module):
    """x times tanh(x): the tanh's output is kept for the product's backward, inside the layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(x)


def test_under_autocast_a_layer_is_sized_as_it_computes_and_its_weights_copies_apart() -> None:
    """Under bf16 autocast a Linear's output is bfloat16, and what a layer keeps is in the dtype it computes in
    (the tanh of a bfloat16 x is bfloat16; the first Linear keeps the batch cast to bfloat16 for its weight's
    gradient). The weight copies autocast saves are LayerProfile.copied, not what a sample keeps."""
    model = nn.Sequential(nn.Linear(8, 16), Scaled(), nn.Linear(16, 4))
    sample = torch.randn(4, 8)
    full = decompose(model, sample, "m").profile.layers
    low = decompose(model, sample, "m", autocast="bfloat16").profile.layers
    assert [layer.input_bytes_per_sample for layer in full] == [32, 64, 64]
    assert [layer.output_bytes_per_sample for layer in full] == [64, 64, 16]
    assert [layer.saved_bytes_per_sample for layer in full] == [0, 64, 0]
    assert [layer.input_bytes_per_sample for layer in low] == [32, 32, 32]
    assert [layer.output_bytes_per_sample for layer in low] == [32, 32, 8]
    assert [layer.saved_bytes_per_sample for layer in low] == [16, 32, 0]
    assert [layer.copied for layer in low] == [{"weight", "bias"}, set(), {"weight", "bias"}]
    assert [layer.copy_bytes for layer in low] == [0, 0, 0], "both Linears' weights halved on the device"


def llama(seed: int, layers: int = 2) -> nn.Module:
    """A Llama 16 wide in float64 (torch.fx cannot trace it: it is exported), built from a config."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=16, intermediate_size=32,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=50,
                                      bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.LlamaForCausalLM(config).double()


def assert_computes(chain: list[nn.Module], model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """chain reads model's own parameters (trained in place) and computes its output on batch bit for bit."""
    own = {id(parameter) for parameter in model.parameters()}
    assert all(id(parameter) in own for layer in chain for parameter in layer.parameters())
    x: Any = batch
    with torch.no_grad():
        for layer in chain:
            x = layer(x)
        expected = model(**batch)
    assert torch.equal(x.logits, expected.logits) and torch.equal(x.loss, expected.loss)


def test_an_exported_chain_rebound_to_a_model_of_its_architecture_computes_that_model_with_its_weights() -> None:
    """A sweep's models are exported once: the others take the first one's stages rebound to their own weights (a
    second or more of export against milliseconds of copying). The copies read the other model's parameters (trained
    in place), compute its output bit for bit, keep the stages' names and descriptions (their layer signatures are
    the source's: they fuse with it), are modules of their own (a mode or a hook set on one is not the stage's, which
    still computes its model), and a model of another architecture is refused."""
    from harmony.runtime.array import layer_signature
    from harmony.runtime.pilot import rebound
    from harmony.runtime.stages import trace_stages

    source, target = llama(0), llama(1)
    ids = torch.randint(0, 50, (4, 12))
    batch = {"input_ids": ids, "labels": ids}
    stages, how = trace_stages(KeywordCall(source), sample=batch)
    assert how.startswith("exported by torch.export")
    copies = rebound(stages, source, target)
    assert [layer_signature(copy) for copy in copies] == [layer_signature(stage) for stage in stages]
    assert_computes(copies, target, batch)
    for copy in copies:  # a copy of its own: its mode and hooks are not its stage's
        copy.eval()
        copy.register_forward_hook(lambda *_: None)
    assert all(stage.training and not stage._forward_hooks for layer in stages for stage in layer.modules())
    assert_computes(stages, source, batch)
    with pytest.raises(ValueError, match="not of its source's architecture"):
        rebound(stages, source, llama(0, layers=3))


def test_exports_export_an_architecture_once_and_give_every_cut_and_model_of_it_that_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A planning's exports: a model cut again for another budget takes its graph again, a model of its architecture
    on alike inputs takes it rebound to its own weights (computing that model bit for bit through stages cut at
    another budget), also on inputs of other sizes that the graph's guards allow (a shorter sequence, a smaller
    batch), and a model of another architecture, or the same on inputs of another structure, is exported."""
    from harmony.runtime import pilot
    from harmony.runtime.pilot import Exports
    from harmony.runtime.stages import trace_stages

    made = []
    export = pilot.exported_graph
    monkeypatch.setattr(pilot, "exported_graph", lambda module, sample: made.append(module.model) or export(
        module, sample))
    exports = Exports()
    first, second, deeper = llama(0), llama(1), llama(2, layers=3)
    ids = torch.randint(0, 50, (4, 12))
    batch = {"input_ids": ids, "labels": ids}
    whole = sum(t.numel() * t.element_size() for t in first.model.layers[0].parameters())
    coarse, _ = trace_stages(KeywordCall(first), whole, batch, exports)
    fine, _ = trace_stages(KeywordCall(first), whole // 2, batch, exports)
    assert len(fine) > len(coarse) and made == [first]
    stages, how = trace_stages(KeywordCall(second), whole // 2, batch, exports)
    assert how.startswith("exported by torch.export") and made == [first] and len(stages) == len(fine)
    assert_computes(stages, second, batch)
    trace_stages(KeywordCall(deeper), whole, batch, exports)
    assert made == [first, deeper]
    shorter = {"input_ids": ids[:3, :8], "labels": ids[:3, :8]}
    stages, _ = trace_stages(KeywordCall(second), whole // 2, shorter, exports)
    assert made == [first, deeper], "the graph holds for 3 sequences of 8"
    assert_computes(stages, second, shorter)
    trace_stages(KeywordCall(second), whole, {"input_ids": ids}, exports)
    assert made == [first, deeper, second]


def _bytes(profile: Any) -> list[tuple[Any, ...]]:
    """What a profile measured of each layer's memory."""
    return [(layer.input_bytes_per_sample, layer.output_bytes_per_sample, layer.saved_bytes_per_sample,
             layer.saved_bytes, layer.transient_bytes_per_sample, layer.transient_bytes) for layer in profile.layers]


def test_a_chain_rebound_takes_its_sources_profile_where_shapes_fix_its_sizes_and_is_measured_where_values_set_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's model whose chain is another's rebound, on a sample of the same shapes, takes that model's profile
    without measuring a layer (alike), where every size its stages compute is fixed by their inputs' shapes (a
    Llama's): measured, its bytes would be the same. Its output is its own. A model that keeps a tensor sized by its
    values (MaskedSquares) is not told so: profiled as it is, its bytes are its own, not its source's."""
    from harmony.runtime import pilot
    from harmony.runtime.pilot import rebound
    from harmony.runtime.stages import sized_by_shapes

    first, second = llama(0), llama(1)
    ids = torch.randint(0, 50, (4, 12))
    batch = {"input_ids": ids, "labels": ids}
    whole = sum(t.numel() * t.element_size() for t in first.model.layers[0].parameters())
    source = decompose(KeywordCall(first), batch, "first", largest=whole // 2, export=True)
    measured = decompose(KeywordCall(second), batch, "second", largest=whole // 2, export=True, timed=source.profile)
    assert len(source.layers) > 3 and _bytes(measured.profile) == _bytes(source.profile)
    kept = pilot._kept
    calls = []
    monkeypatch.setattr(pilot, "_kept", lambda *a, **k: calls.append(1) or kept(*a, **k))
    chain = rebound(source.layers, first, second)
    assert sized_by_shapes(source.layers)
    taken = decompose(KeywordCall(second), batch, "second", cut=(chain, source.notes), alike=source.profile)
    assert not calls and taken.profile == replace(source.profile, name="second") and taken.notes == source.notes
    assert torch.equal(taken.output.loss, second(**batch).loss)

    below, above = MaskedSquares(), MaskedSquares()
    with torch.no_grad():
        below.a.bias.fill_(-100.0)  # no hidden unit positive: nothing kept
        above.a.bias.fill_(100.0)  # every one
    x = torch.randn(6, 8)
    source = decompose(below, x, "below", export=True)
    own = decompose(above, x, "above", export=True)
    assert not sized_by_shapes(source.layers)
    taken = decompose(above, x, "above", cut=(rebound(source.layers, below, above), source.notes))
    assert calls and _bytes(taken.profile) == _bytes(own.profile) != _bytes(source.profile)
