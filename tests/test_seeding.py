"""Random streams by model, layer, step and micro-batch: seeds, numbering, and the drawing layers' hooks."""

from __future__ import annotations

import threading

import torch
from torch import nn

from harmony.runtime.compiled import pack_call
from harmony.runtime.seeding import begin, layer_seed, microbatch_number, reseed
from harmony.tasks.microbatch import deal

CPU = torch.device("cpu")


def chain() -> list[nn.Module]:
    return [nn.Linear(16, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4)]


def test_every_layer_step_and_microbatch_of_a_job_has_its_own_seed() -> None:
    seeds = {layer_seed(base, layer, step, microbatch)
             for base in range(3) for layer in range(20) for step in range(20) for microbatch in range(4)}
    assert len(seeds) == 3 * 20 * 20 * 4
    assert all(0 <= seed < 2**63 - 1 for seed in seeds)


def test_groups_deal_out_the_microbatches_so_that_their_numbers_cover_the_step_once() -> None:
    for microbatches in range(1, 9):
        for groups in range(1, 5):
            dealt = deal(range(microbatches), groups)
            assert [[microbatch_number(group, index, groups) for index in range(len(part))]
                    for group, part in enumerate(dealt)] == dealt, (microbatches, groups)
            assert sorted(number for part in dealt for number in part) == list(range(microbatches))


def test_a_drawing_layer_draws_from_its_own_stream_however_the_chain_is_cut() -> None:
    """The whole chain in one module, or cut in two after the first dropout: the same masks, and each pack's first
    draw repeats when the pack runs again (a recompute)."""
    torch.manual_seed(0)
    layers = chain()
    x = torch.randn(8, 16)
    whole = reseed(nn.Sequential(*layers), 0, (1, 4))
    begin(CPU, 3, step=5, microbatch=1)
    expected = whole(x)
    front, back = reseed(nn.Sequential(*layers[:2]), 0, (1,)), reseed(nn.Sequential(*layers[2:]), 2, (4,))
    for _ in range(2):
        begin(CPU, 3, step=5, microbatch=1, layer=0)
        boundary = front(x)
        begin(CPU, 3, step=5, microbatch=1, layer=2)
        assert torch.equal(back(boundary), expected)
    begin(CPU, 3, step=5, microbatch=2)
    assert not torch.equal(whole(x), expected), "another micro-batch, other masks"


def test_only_the_thread_that_began_a_microbatch_reseeds() -> None:
    """A hook on a thread that set no micro-batch (the driver, a host thread) leaves the generator alone."""
    layer = reseed(nn.Sequential(nn.Dropout(0.5)), 0, (0,))
    drawn = []

    def run() -> None:
        torch.manual_seed(7)
        drawn.append(layer(torch.ones(64)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    torch.manual_seed(7)
    assert torch.equal(drawn[0], nn.Dropout(0.5)(torch.ones(64)))


def test_compiled_packs_reseed_between_segments_and_compile_each_once() -> None:
    """A compiled pack runs in segments that each start at a drawing layer, reseeded eagerly between them: the
    masks an eager pack draws, and one graph per segment however many micro-batches (traced, the hook's
    micro-batch number would compile every call anew; inside functional_call, a graph break runs it all eagerly)."""
    torch.manual_seed(0)
    layers = chain()
    tensors = {name: value.detach() for name, value in nn.Sequential(*layers).named_parameters()}
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = pack_call(nn.Sequential(*chain()), "eager", compile=False, drawing=(1, 4))
    compiled = pack_call(nn.Sequential(*chain()), "compiled", compile=True, drawing=(1, 4))
    for microbatch in range(4):
        begin(CPU, 0, step=0, microbatch=microbatch)
        expected = eager(tensors, x)
        begin(CPU, 0, step=0, microbatch=microbatch)
        torch.testing.assert_close(compiled(tensors, x), expected)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 3, f"{graphs} graphs: one per segment (layers 0, 1-3, 4-5)"
    assert not torch._dynamo.utils.counters["graph_break"]
