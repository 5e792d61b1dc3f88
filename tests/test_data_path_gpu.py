"""The data_path rung on a real GPU: side-stream prefetch hands out the same values (nested
batches, non-tensor leaves), marks every tensor used by the consumer's stream, never serves stale
data from a reused host buffer, and a Lightning fit on CUDA sees the same samples in the same order."""

from __future__ import annotations

import dataclasses
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from speedkit.data.prefetch import DevicePrefetcher, PrefetchingLoader

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).resolve().parent))

Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Item:
    image: torch.Tensor
    name: str


def _batch(i: int):
    return {
        "pair": Pair(torch.full((256, 256), float(i)), [torch.arange(4) + i, "tag", i]),
        "item": Item(torch.full((3, 8, 8), -float(i)), f"n{i}"),
        "none": None,
    }


@pytest.mark.parametrize("lookahead", [0, 1])
def test_prefetched_batches_hold_the_host_values_on_the_device(lookahead):
    host = [_batch(i) for i in range(6)]
    prefetcher = DevicePrefetcher(iter(host), "cuda", lookahead=lookahead)
    for i, batch in enumerate(prefetcher):
        x = batch["pair"].x
        assert x.is_cuda and isinstance(batch["pair"], Pair) and isinstance(batch["item"], Item)
        big = torch.randn(2048, 2048, device="cuda")
        for _ in range(5):  # keep the consumer's stream busy while the next copy runs
            big = big @ big / 2048
        assert torch.equal(x.cpu(), host[i]["pair"].x) and torch.equal(batch["pair"].y[0].cpu(), host[i]["pair"].y[0])
        assert batch["pair"].y[1:] == ["tag", i] and batch["item"].name == f"n{i}" and batch["none"] is None
        assert torch.equal(batch["item"].image.cpu(), host[i]["item"].image)
    assert prefetcher.times.batches == 6 and prefetcher.times.median_ms() > 0


def test_a_reused_pinned_host_buffer_is_never_served_stale():
    buffer = torch.empty(1 << 20).pin_memory()

    def refilled():
        for i in range(20):
            buffer.fill_(float(i))  # the loader reuses its one pinned buffer
            yield buffer

    seen = [float(b[0].item()) + float(b[-1].item()) for b in DevicePrefetcher(refilled(), "cuda", lookahead=1)]
    assert seen == [2.0 * i for i in range(20)]


def test_every_tensor_is_recorded_on_the_consumers_stream(monkeypatch):
    recorded = []
    original = torch.Tensor.record_stream
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: (recorded.append((t.data_ptr(), s)), original(t, s))[1])
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        batches = list(DevicePrefetcher(iter([_batch(i) for i in range(3)]), "cuda"))
    assert len(recorded) == 3 * 3 and all(s == consumer for _, s in recorded)
    assert {p for p, _ in recorded} == {t.data_ptr() for b in batches for t in (b["pair"].x, b["pair"].y[0], b["item"].image)}


def test_the_prefetching_loader_serves_each_epoch_on_the_device():
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(32.0)), batch_size=4, num_workers=2, pin_memory=True
    )
    wrapped = PrefetchingLoader(loader, "cuda", lookahead=1)
    for _ in range(2):
        got = [b[0] for b in wrapped]
        assert all(t.is_cuda for t in got) and torch.cat(got).cpu().tolist() == list(map(float, range(32)))
    assert len(wrapped) == 8 and wrapped.times.batches == 16


@pytest.mark.parametrize("mode", ["given", "trials"])
def test_a_cuda_fit_with_data_path_sees_the_same_samples_in_the_same_order(mode, monkeypatch):
    import lightning.pytorch as pl
    from test_data_path import Seen, _fit, data_path_ladder

    def fit(callbacks):
        original = pl.Trainer.__init__
        monkeypatch.setattr(
            pl.Trainer, "__init__", lambda self, *a, **k: original(self, *a, **{**k, "accelerator": "gpu", "devices": 1})
        )
        try:
            return _fit("global_rng", 0, callbacks)
        finally:
            monkeypatch.setattr(pl.Trainer, "__init__", original)

    plain = fit([])
    ladder = data_path_ladder(mode, 2, monkeypatch)
    fast: Seen = fit([ladder])
    changes = ladder.applied_changes["data_path"]
    assert any("side stream" in c for c in changes) and any("made again" in c for c in changes), changes
    assert len(plain.seen) == 24 and fast.seen == plain.seen and fast.draws == plain.draws
    assert fast.made_by == {0, 1}


def _augmented_fits(pin: bool, model: str = "AugmentedModel", **trainer_options):
    """Three CUDA epochs of a loader with two persistent workers whose samples draw random numbers
    (``model``: a module of test_data_path): what the fit sees without speedkit and with the data_path
    rung in exact mode (the worker count kept; ``pin``: a pinned copy of the loader), and the SpeedLadder."""
    import test_data_path
    from test_data_path import fit_and_see

    from speedkit.lightning import SpeedLadder

    def fit(callbacks):
        return fit_and_see(
            lambda: getattr(test_data_path, model)("global_rng", 2, True),
            callbacks,
            accelerator="gpu",
            devices=1,
            max_epochs=3,
            **trainer_options,
        )

    plain = fit([])
    # exact: every augmentation as it was (by default a pinned copy may take another prefetch factor)
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": "keep", "pin_memory": pin, "exact": True}}])
    return plain, fit([ladder]), ladder


@pytest.mark.parametrize("limit", [3, 1.0], ids=["cut", "whole"])
@pytest.mark.parametrize(
    "pin, first", [(False, "prefetched as it is"), (True, "made again")], ids=["users-loader", "pinned-copy"]
)
def test_a_cuda_fit_of_a_persistent_loader_prefetched_makes_and_draws_what_it_would(limit, pin, first):
    """Persistent workers whose samples draw random numbers, the worker count kept: the user's own
    loader only prefetched (its first-epoch iterator, which Lightning made, prefetched as it is), or a
    copy of it pinned (asked for: "auto" keeps the user's loader where pinning measures no faster),
    whose first-epoch iterator is made again. An epoch cut by ``limit_train_batches`` pulls no further
    than Lightning takes, so every sample, augmentation and draw is what the fit without speedkit sees."""
    plain, fast, ladder = _augmented_fits(pin, limit_train_batches=limit)
    changes = ladder.applied_changes["data_path"]
    assert any("side stream" in c for c in changes) and any(first in c for c in changes), changes
    # the pinned copy keeps the loader's prefetch_factor, whatever measured fastest (see test_data_path)
    assert any(c.startswith("note: prefetch_factor kept at 2") for c in changes) == pin, changes
    assert len(plain.seen) == (9 if limit == 3 else 36) and fast.seen == plain.seen and fast.draws == plain.draws
    assert fast.values == plain.values and fast.made_by == {0, 1}, changes


@pytest.mark.parametrize("pin", [False, True], ids=["users-loader", "pinned-copy"])
def test_a_cuda_fit_whose_module_ends_epochs_at_batch_start_makes_and_draws_what_it_would(pin):
    """``on_train_batch_start`` returns -1 at each epoch's fifth batch: the batch ahead is pulled and
    copied only once the hook let the step run, so the persistent workers make and draw what they
    would without speedkit, and every batch the steps see holds its host values."""
    plain, fast, ladder = _augmented_fits(pin, "EndsEpochsEarly")
    changes = ladder.applied_changes["data_path"]
    assert any("side stream" in c for c in changes) and any("lets the step run" in c for c in changes), changes
    assert len(plain.seen) == 15 and fast.seen == plain.seen and fast.draws == plain.draws
    assert fast.values == plain.values and fast.made_by == {0, 1}, changes


class _Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int):
        return {"x": torch.full((3, 64, 64), float(i)), "y": i, "tag": f"t{i}"}


@pytest.mark.parametrize("persistent", [False, True], ids=["workers_per_epoch", "persistent_workers"])
def test_batches_through_the_ring_reach_the_device_unchanged_over_epochs(persistent):
    """Two whole epochs; with persistent workers an epoch cut short after 3 batches first (its workers
    had more batches packed, which the next epoch drops and whose slots come back)."""
    from torch.utils.data import DataLoader

    from speedkit import compat
    from speedkit.data.ring import BatchRing, handoff_loader, slot_bytes_for

    def loader_with(seed: int) -> DataLoader:
        return DataLoader(
            _Images(),
            batch_size=4,
            shuffle=True,
            num_workers=3,
            persistent_workers=persistent,
            generator=torch.Generator().manual_seed(seed),
        )

    ring = BatchRing(workers=3, slots_per_worker=4, slot_bytes=slot_bytes_for(4 * 3 * 64 * 64 * 4 + 64), wait_s=30.0)
    assert ring.register()
    handoff = handoff_loader(loader_with(2), ring)
    served = PrefetchingLoader(handoff, "cuda", lookahead=1, ring=ring)
    cuts = [3, None, None] if persistent else [None, None]
    got = []
    for cut in cuts:
        for i, batch in enumerate(served):
            assert batch["x"].is_cuda and batch["tag"][0].startswith("t")
            big = torch.randn(1024, 1024, device="cuda")
            for _ in range(3):  # the consumer's stream busy while the next copy runs
                big = big @ big / 1024
            got.append((batch["x"].cpu(), batch["y"].cpu(), batch["tag"]))
            if cut is not None and i + 1 == cut:
                break
    served.close()
    ring.close()
    assert not compat.has_live_iterator(handoff)  # persistent workers stopped with the loader that served them
    plain = loader_with(2)
    want = []
    if persistent:  # the cut epoch as the prefetcher pulled it: 3 batches served and the one it had taken ahead
        # (how far the cut epoch read decides the next epoch's shuffle: the 4th batch makes the loader hand its
        # workers the last indices, and torch's RandomSampler draws one more permutation after its last index)
        it = iter(plain)
        want = [next(it) for _ in range(4)][:3]
    want += [b for _ in range(2) for b in plain]
    compat.shutdown_workers(plain)
    want = [(b["x"], b["y"], b["tag"]) for b in want]
    assert len(got) == len(want) == len(cuts) * 10 - (7 if persistent else 0)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(got, want))
    # every batch came through the ring (none waited out wait_s; the cut epoch's prefetcher had also taken the
    # batch after its last one), every copy waited for and its slot freed
    assert served.times.via_ring == len(got) + (1 if persistent else 0) and bool(ring.free.all()) and not ring.registered
    assert ring.recovered > 0 if persistent else ring.recovered == 0


class Stamped(torch.utils.data.Dataset):
    """Sample i: an image of ``side`` x ``side`` holding i everywhere, and i (a batch can check itself)."""

    def __init__(self, side: int = 64) -> None:
        self.side = side

    def __len__(self) -> int:
        return 997

    def __getitem__(self, i: int):
        return {"x": torch.full((3, self.side, self.side), float(i)), "y": i}


@pytest.mark.parametrize("persistent", [False, True], ids=["workers_per_epoch", "persistent_workers"])
def test_the_ring_serves_no_wrong_batch_over_cut_epochs_and_random_step_lengths(persistent):
    """Twelve epochs of 4 workers writing into a ring of 4 slots each, six of them cut (at batches 1 to
    58, the last epoch whole), each step busy on the GPU for a random time before it reads its batch:
    every batch, checked on the device (its values against its indices), is whole; slots come back
    from cut epochs, and none is left claimed after a whole last epoch."""
    import random

    from torch.utils.data import DataLoader

    from speedkit.data.ring import BatchRing, handoff_loader, slot_bytes_for

    rnd = random.Random(0)
    loader = DataLoader(Stamped(), batch_size=8, shuffle=True, num_workers=4, persistent_workers=persistent)
    ring = BatchRing(workers=4, slots_per_worker=4, slot_bytes=slot_bytes_for(8 * 3 * 64 * 64 * 4 + 64), wait_s=30.0)
    assert ring.register()
    served = PrefetchingLoader(handoff_loader(loader, ring), "cuda", lookahead=1, ring=ring)
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")
    batches = 0
    for cut in [None, 7, None, 33, 1, None, 58, 2, None, 20, None, None]:
        for i, batch in enumerate(served):
            if i == cut:
                break
            torch.cuda._sleep(rnd.randint(0, 400_000))  # the step: up to ~0.3 ms of GPU work before the batch is read
            x, y = batch["x"], batch["y"]
            wrong += (x.view(len(y), -1) != y.to(x.dtype)[:, None]).any(dim=1).sum()
            batches += 1
    served.close()
    ring.close()
    assert int(wrong) == 0 and batches == 6 * 125 + (7 + 33 + 1 + 58 + 2 + 20)
    assert served.times.via_ring >= batches and bool(ring.free.all())
    assert ring.recovered > 0 if persistent else ring.recovered == 0


@pytest.mark.parametrize("pin", [False, True], ids=["users-loader", "pinned-copy"])
def test_a_cuda_fit_that_reloads_its_train_loader_is_served_after_each_reload(pin):
    """``reload_dataloaders_every_n_epochs=1`` on CUDA, persistent workers whose samples draw random
    numbers: each reloaded loader is served like the first (prefetched; the pinned copy through a new
    ring), and the fit sees every sample, draw and augmentation it sees without speedkit."""
    plain, fast, ladder = _augmented_fits(pin, reload_dataloaders_every_n_epochs=1)
    changes = ladder.applied_changes["data_path"]
    assert any("is served the same way" in c for c in changes), changes
    assert any("ring of shared pinned memory" in c for c in changes) == pin, changes
    assert len(plain.seen) == 36 and fast.seen == plain.seen and fast.draws == plain.draws
    assert fast.values == plain.values and fast.made_by == {0, 1}, changes
    assert ladder.handles == []
