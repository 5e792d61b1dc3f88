"""The digest of a run's starting point (speedkit.training.digest, Snapshot.digest): equal for the same
weights, optimizer state, random states and batches, different where any of them differs by one bit."""

from collections import UserDict
from dataclasses import dataclass

import torch

from speedkit.training import digest as digest_module
from speedkit.training.digest import state_digest
from speedkit.training.snapshot import Snapshot


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 7)).sum().backward()
    optimizer.step()  # optimizer state to digest
    optimizer.zero_grad()
    return model, optimizer


def test_the_same_start_gives_the_same_digest_and_one_bit_changes_it():
    batches = [{"x": torch.randn(4, 7), "y": torch.arange(4)}]
    torch.manual_seed(1)
    a = Snapshot(*_model_and_optimizer())
    torch.manual_seed(1)
    b = Snapshot(*_model_and_optimizer())
    torch.manual_seed(1)  # the process RNG as the snapshots captured it
    assert a.digest(batches) == b.digest(batches)
    # a weight one ulp away
    weight = next(b.model.parameters())
    with torch.no_grad():
        weight.view(-1)[5] = torch.nextafter(weight.view(-1)[5], torch.tensor(1e9))
    assert a.digest(batches) != b.digest(batches)
    # the optimizer's moments, the batches, the random state
    c = Snapshot(*_model_and_optimizer())
    assert a.digest(batches) != Snapshot(*_model_and_optimizer(seed=3)).digest(batches)
    other = [{"x": batches[0]["x"].clone(), "y": torch.tensor([0, 1, 2, 4])}]
    assert c.digest(batches) != c.digest(other)
    rng_before = c.digest(batches)
    c.rng.process["torch"] = torch.manual_seed(2).get_state()
    assert c.digest(batches) != rng_before


def test_the_digest_reads_library_batches_and_large_tensors_in_chunks(monkeypatch):
    @dataclass
    class Batch:
        pixels: torch.Tensor
        label: int

    monkeypatch.setattr(digest_module, "_CHUNK", 7)  # odd chunks over odd sizes
    x = torch.randn(5, 11, dtype=torch.bfloat16)
    encoding = UserDict({"input_ids": torch.arange(29), "mask": torch.ones(29, dtype=torch.bool)})
    base = state_digest([x, encoding, Batch(x.float(), 3)])
    assert base == state_digest([x.clone(), UserDict(dict(encoding)), Batch(x.float().clone(), 3)])
    moved = x.clone()
    moved.view(-1)[54] += 1  # the last element, in the last chunk
    assert state_digest([moved, encoding, Batch(x.float(), 3)]) != base
    assert state_digest([x, UserDict({**encoding, "mask": torch.zeros(29, dtype=torch.bool)}), Batch(x.float(), 3)]) != base
    assert state_digest([x, encoding, Batch(x.float(), 4)]) != base
    swapped = torch.arange(29).flip(0)  # the same values elsewhere: the position weights tell them apart
    assert state_digest([swapped]) != state_digest([torch.arange(29)])


def test_a_state_the_digest_cannot_read_leaves_the_run_to_the_baselines_judgement(tmp_path, monkeypatch):
    """A digest that raises (a tensor it cannot read) is no failed run: no start is recorded, and a
    cached decision is judged against the baseline as before."""
    from fakes import SpeedRung, VirtualTime, timed_state

    from speedkit.engine.cache import DecisionCache
    from speedkit.engine.ladder import Ladder

    def unreadable(self, *extra):
        raise RuntimeError("view is not supported for sparse tensors")

    monkeypatch.setattr(Snapshot, "digest", unreadable)
    cache = DecisionCache(tmp_path)
    results = []
    for _ in range(2):
        time = VirtualTime(noise=0.005, seed=0)
        ladder = Ladder(
            timed_state(time, 0.02),
            [SpeedRung("x", time, 0.02, -0.3)],
            {"warmup": 1, "steps": 3, "repeats": 3, "min_blocks": 4, "switches_floor": False, "profile": False},
            clock=time.clock(),
            host_clock=time,
            cache=cache,
        )
        results.append(ladder.run())
        assert ladder.start_digest is None
        ladder.revert()
    assert cache.entries()[0].trajectory is None
    note = results[1].run["cache"]
    assert note["held"] is True and note["parity_against"] == "the baseline"
