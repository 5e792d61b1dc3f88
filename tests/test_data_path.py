"""The data_path rung on CPU: the rebuilt loader serves the same samples in the same order (seeds
included), the prefetcher hands out the same batches, apply/undo is exact, a Lightning fit with the
rung bound sees exactly what it sees without speedkit, and settings are chosen on a fake clock."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from collections import namedtuple
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from speedkit import compat, rungs
from speedkit.data import BatchSource
from speedkit.data.choose import choose_settings, loader_rate
from speedkit.data.prefetch import DevicePrefetcher, PrefetchingLoader
from speedkit.data.settings import LoaderSettings, rebuild_loader
from speedkit.data.workers import worker_dependence
from speedkit.errors import ConfigError
from speedkit.lightning import SpeedLadder
from speedkit.lightning import data as lightning_data
from speedkit.lightning.data import DataPathFit, overridden_transfer_hooks
from speedkit.rungs import data_path
from speedkit.rungs.data_path import DataPathRung, DataPathSource, Plan
from speedkit.training.state import TrainState

CPU = torch.device("cpu")


class Indexed(Dataset):
    """Sample i: (i as a tensor, a feature row made from i alone, the id of the worker that made it)."""

    def __init__(self, n: int = 48) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        return torch.tensor(i), torch.full((4,), float(i)), torch.tensor(info.id if info is not None else -1)


class RandomCrops(Indexed):
    """Draws from the global RNG per sample, as augmentations do."""

    def __getitem__(self, i: int):
        return torch.tensor(i), torch.rand(4)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def _loader(shuffle: str, workers: int = 0, cls: type = DataLoader, **kw) -> DataLoader:
    generator = torch.Generator().manual_seed(7) if shuffle == "generator" else None
    return cls(Indexed(), batch_size=4, shuffle=True, generator=generator, num_workers=workers, **kw)


def _two_epochs(loader) -> tuple[list[list[int]], torch.Tensor]:
    torch.manual_seed(123)
    order = [[int(i) for i in batch[0]] for _ in range(2) for batch in loader]
    return order, torch.get_rng_state()


# -- rebuild_loader ---------------------------------------------------------------------------------


class MyLoader(DataLoader):
    pass


@pytest.mark.parametrize("cls", [DataLoader, MyLoader])
def test_rebuild_keeps_every_object_and_changes_only_the_settings(cls):
    loader = _loader(
        "generator",
        cls=cls,
        collate_fn=torch.utils.data.default_collate,
        drop_last=True,
        timeout=0,
        worker_init_fn=lambda i: None,
    )
    live = iter(loader)
    clone = rebuild_loader(loader, num_workers=2, pin_memory=True, persistent_workers=True, prefetch_factor=4)
    assert type(clone) is cls and clone is not loader
    for name in (
        "dataset",
        "sampler",
        "batch_sampler",
        "collate_fn",
        "worker_init_fn",
        "generator",
        "drop_last",
        "timeout",
        "multiprocessing_context",
        "batch_size",
    ):
        assert getattr(clone, name) is getattr(loader, name), name
    assert (clone.num_workers, clone.pin_memory, clone.persistent_workers, clone.prefetch_factor) == (2, True, True, 4)
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers, loader.prefetch_factor) == (0, False, False, None)
    assert LoaderSettings.of(clone) == LoaderSettings(2, True, True, 4)
    assert clone.__dict__["_iterator"] is None
    back = rebuild_loader(clone, num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None)
    assert back.prefetch_factor is None and back.persistent_workers is False
    del live


@pytest.mark.parametrize("shuffle", ["generator", "global_rng"])
@pytest.mark.parametrize("workers", [(0, 2), (2, 0), (0, 0)], ids=["0->2", "2->0", "0->0"])
def test_the_rebuilt_loader_yields_the_same_samples_in_the_same_order_over_two_epochs(shuffle, workers):
    original = _loader(shuffle, workers[0])
    clone = rebuild_loader(
        original, num_workers=workers[1], pin_memory=False, persistent_workers=False, prefetch_factor=2 if workers[1] else None
    )
    if shuffle == "generator":
        original.generator.manual_seed(7)
    expected, rng_after = _two_epochs(original)
    if shuffle == "generator":
        clone.generator.manual_seed(7)  # the same generator object: put it back where it started
    got, rng_after_clone = _two_epochs(clone)
    assert got == expected and len(got) == 24
    assert sorted(sum(got[:12], [])) == list(range(48)) and got[:12] != got[12:]  # shuffled, per epoch
    assert torch.equal(rng_after, rng_after_clone)  # the same draws from the global RNG


def test_bad_settings_are_one_line_errors():
    loader = _loader("global_rng")
    for kwargs, where in [
        (dict(num_workers=-1, pin_memory=False, persistent_workers=False, prefetch_factor=None), "data.num_workers"),
        (dict(num_workers=0, pin_memory=False, persistent_workers=True, prefetch_factor=None), "data.num_workers"),
        (dict(num_workers=2, pin_memory=False, persistent_workers=False, prefetch_factor=0), "data.prefetch_factor"),
    ]:
        with pytest.raises(ConfigError) as err:
            rebuild_loader(loader, **kwargs)
        assert str(err.value).startswith(where) and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        rebuild_loader([1, 2], num_workers=2, pin_memory=False, persistent_workers=False, prefetch_factor=2)  # type: ignore[arg-type]
    assert "not a torch DataLoader" in str(err.value) and "\n" not in str(err.value)
    for options in ({"workers": -1}, {"workers": "many"}, {"prefetch": "yes"}, {"threads": 2}):
        with pytest.raises(ConfigError) as err:
            rungs.make({"name": "data_path", "options": options})
        assert str(err.value).startswith("rung") and "\n" not in str(err.value)


class Flips(Indexed):
    """Flips a sample with probability 0.5, as ``RandomHorizontalFlip`` does: under seeds 1 and 2 of
    the probe neither read flips (``torch.rand(1)`` is 0.758 and 0.615), yet each worker would flip others."""

    def __getitem__(self, i: int):
        index, x, _ = super().__getitem__(i)
        return index, x.flip(0) if torch.rand(1) < 0.5 else x


class PythonCoin(Indexed):
    def __getitem__(self, i: int):
        index, x, _ = super().__getitem__(i)
        return index, -x if random.random() < 0.01 else x


class NumpyCoin(Indexed):
    def __getitem__(self, i: int):
        import numpy as np

        index, x, _ = super().__getitem__(i)
        return index, -x if np.random.rand() < 0.01 else x


class CropsTheLastOnly(Indexed):
    def __getitem__(self, i: int):
        index, x, _ = super().__getitem__(i)
        return index, x + torch.rand(4) if i == len(self) - 1 else x


def test_the_worker_count_is_kept_where_samples_depend_on_the_worker():
    torch.manual_seed(5)
    before = torch.get_rng_state(), random.getstate()
    assert worker_dependence(Indexed()) is None
    assert "draw random numbers" in str(worker_dependence(RandomCrops()))
    assert "IterableDataset" in str(worker_dependence(Stream()))
    # a draw whose outcome both probing seeds happen to agree on is still a draw
    for dataset, rng in ((Flips(), "torch"), (PythonCoin(), "python"), (NumpyCoin(), "numpy")):
        assert f"samples draw random numbers (reading one draws from the {rng} RNG)" in str(worker_dependence(dataset))
    assert "torch RNG" in str(worker_dependence(CropsTheLastOnly()))  # the first, middle and last items are read
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]  # the probe draws nothing


# -- choosing the settings ------------------------------------------------------------------------


def test_the_cheapest_settings_within_three_percent_of_the_best_are_chosen():
    table = {(0, None): 100.0, (2, 2): 190.0, (2, 4): 191.0, (4, 2): 195.0, (4, 4): 196.0, (8, 2): 150.0}
    asked = []

    def measure(s: LoaderSettings) -> float:
        asked.append(s)
        return table[(s.num_workers, s.prefetch_factor)]

    choice = choose_settings(
        _loader("global_rng"), CPU, cpus=10, measure=measure
    )  # two cores stay for the step: 8 workers at most
    assert [s.num_workers for s in asked] == [0, 2, 4, 8, 4] and asked[-1].prefetch_factor == 4  # 4 for the best count only
    assert choice.settings == LoaderSettings(4, False, False, 2)  # 195 >= 0.97 * 196; 190 is not
    assert choice.changed and choice.rate(choice.current) == 100.0
    assert "num_workers=4, prefetch_factor=4, persistent_workers=False, pin_memory=False: 196.0" in choice.lines()[0]
    same = choose_settings(_loader("global_rng"), CPU, cpus=10, measure=lambda s: 100.0 - s.num_workers / 10)
    assert not same.changed  # all within 3%: the current (cheapest) settings stay
    fixed = choose_settings(_loader("global_rng"), CPU, workers=2, measure=measure)
    assert fixed.settings.num_workers == 2  # a worker count given by option is taken
    persistent = choose_settings(_loader("global_rng"), CPU, cpus=4, exact=False, measure=measure)
    assert persistent.settings == LoaderSettings(2, False, True, 2) and "persistent_workers on" in persistent.notes[0]


def test_loader_rate_reads_the_clock_over_a_warmed_up_window():
    made = [0]

    class Counted(Indexed):
        def __getitem__(self, i):
            made[0] += 1
            return super().__getitem__(i)

    loader = DataLoader(Counted(8), batch_size=4)  # two batches an epoch: the window restarts it
    clock = lambda: made[0] * 0.01  # noqa: E731  # 10 ms of fake time per sample made
    assert loader_rate(loader, CPU, clock=clock, warmup=3, batches=16) == pytest.approx(25.0)  # 16 / (64 * 0.01 s)
    assert made[0] == 4 * 19
    made[0] = 0
    assert loader_rate(loader, CPU, clock=clock, warmup=1, batches=16, max_s=0.1) == pytest.approx(25.0)
    assert made[0] == 4 * (1 + 3)  # stopped past 0.1 s: 3 batches timed


def test_measuring_real_loaders_puts_the_rng_and_generators_back():
    loader = _loader("generator")
    torch.manual_seed(9)
    before = torch.get_rng_state(), loader.generator.get_state()
    choice = choose_settings(loader, CPU, cpus=4, max_s=0.2)
    assert {s.num_workers for s, _ in choice.rates} == {0, 2} and all(r > 0 for _, r in choice.rates)
    assert torch.equal(torch.get_rng_state(), before[0]) and torch.equal(loader.generator.get_state(), before[1])


# -- the prefetcher ---------------------------------------------------------------------------------

Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Item:
    image: torch.Tensor
    name: str


def _nested_batches():
    return [
        {"pair": Pair(torch.ones(2) * i, [torch.arange(3), "tag", i]), "item": Item(torch.zeros(1, 2), f"n{i}"), "none": None}
        for i in range(3)
    ]


def test_on_cpu_the_prefetcher_is_a_passthrough_of_the_same_batches():
    batches = _nested_batches()
    for lookahead in (0, 1):
        got = list(DevicePrefetcher(iter(batches), CPU, lookahead=lookahead))
        assert len(got) == 3 and all(a is b for a, b in zip(got, batches))
    wrapped = PrefetchingLoader(_loader("generator"), CPU)
    assert len(wrapped) == 12 and wrapped.sampler is wrapped.loader.sampler and wrapped.dataset is wrapped.loader.dataset
    assert [b[0].tolist() for b in wrapped] == [
        b[0].tolist() for b in (wrapped.loader.generator.manual_seed(7) and wrapped.loader)
    ]
    with pytest.raises(ValueError):
        DevicePrefetcher(iter([]), CPU, lookahead=2)


def _counted(pulled: list[int], n: int):
    """Batches 0..n-1, each noted in ``pulled`` when it is pulled."""
    for i in range(n):
        pulled.append(i)
        yield i


def test_a_prefetcher_pulls_one_batch_ahead_and_no_more_than_its_limit():
    pulled: list[int] = []
    counted = functools.partial(_counted, pulled)
    ahead = DevicePrefetcher(counted(6), CPU, lookahead=1)
    assert next(ahead) == 0 and pulled == [0, 1]  # the next batch pulled while this one is used
    capped = DevicePrefetcher(counted(6), CPU, lookahead=1, limit=3)
    pulled.clear()
    assert list(capped) == [0, 1, 2] and pulled == [0, 1, 2] and capped.pulled == 3
    pulled.clear()
    assert list(DevicePrefetcher(counted(6), CPU, lookahead=0, limit=0)) == [] and pulled == []
    with pytest.raises(ValueError, match="limit"):
        DevicePrefetcher(iter([]), CPU, limit=-1)


def test_a_prefetcher_told_when_to_pull_ahead_pulls_nothing_early_before_it_is_told():
    pulled: list[int] = []
    told = DevicePrefetcher(_counted(pulled, 4), CPU, lookahead=1, ahead_when_told=True)
    assert next(told) == 0 and pulled == [0]  # handed out: nothing pulled ahead yet
    told.pull_ahead()
    told.pull_ahead()  # told twice: still one batch ahead
    assert pulled == [0, 1] and next(told) == 1 and pulled == [0, 1]
    assert next(told) == 2 and pulled == [0, 1, 2]  # never told: pulled when asked for
    told.close()
    told.pull_ahead()  # closed: pulls nothing more
    assert pulled == [0, 1, 2] and list(told) == []


def test_prefetching_reads_into_the_next_epoch_only_when_the_loop_asks_for_it():
    """Making an epoch's iterator draws its shuffle (and its workers' base seed) from the global RNG,
    which the step draws from too (dropout): the next epoch is shuffled as in the plain loop only if
    its iterator is made after the last step of the epoch before, not one batch ahead of it."""
    loader = _loader("global_rng")  # 12 batches per epoch

    def run(batches) -> list[list[int]]:
        torch.manual_seed(5)
        seen, it = [], batches()
        for _ in range(30):  # two and a half epochs
            seen.append(next(it)[0].tolist())
            torch.rand(())  # the step's own draw
        return seen

    def plain():
        while True:
            yield from loader

    source = DataPathSource(BatchSource(loader, CPU), Plan(None, True, 1, []))
    want = run(plain)
    assert run(source.iterator) == want
    # a single prefetcher over the chained epochs makes the next epoch's iterator a step early: another shuffle
    assert run(lambda: DevicePrefetcher(source.host_batches(), CPU, lookahead=1)) != want


# -- the rung -------------------------------------------------------------------------------------


def _state(dataset=None, workers: int = 0, generator: bool = True) -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    loader = DataLoader(
        dataset if dataset is not None else Indexed(),
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(3) if generator else None,
        num_workers=workers,
    )
    return TrainState(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device=CPU, data=BatchSource(loader, CPU)
    )


def test_apply_serves_the_same_batches_from_the_rebuilt_loader_and_undo_is_exact():
    state = _state(generator=False)
    original, loader = state.data, state.data.loader
    settings_before = dict(loader.__dict__)
    rung = rungs.make({"name": "data_path", "options": {"workers": 2}})
    assert rung.check(state) is None
    handle = rung.apply(state)
    wrapper = state.data
    assert isinstance(wrapper, DataPathSource) and wrapper.inner is original
    assert wrapper.rebuilt.num_workers == 2 and wrapper.rebuilt.sampler is loader.sampler
    assert any("num_workers=2" in c for c in handle.changes)
    assert torch.multiprocessing.get_sharing_strategy() == "file_system" and any("file_system" in c for c in handle.changes)
    torch.manual_seed(1)
    got = [b for _, b in zip(range(15), wrapper.iterator())]  # across an epoch boundary, through named shared memory
    torch.manual_seed(1)
    want = [b for _, b in zip(range(15), original.iterator())]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
    assert {int(w) for b in got for w in b[2]} <= {0, 1} and got[0][2].min() >= 0  # made by the rebuilt loader's workers
    assert wrapper.parity_batches(1)[0][0].shape == (4,) and wrapper.generators() == original.generators() == []
    assert any("ms per batch waited" in line for line in handle.report())
    handle.suspend()
    assert state.data is original and torch.multiprocessing.get_sharing_strategy() == "file_system"  # changes no value
    handle.resume()
    assert state.data is wrapper
    handle.undo()
    assert state.data is original and loader.__dict__ == settings_before and loader.num_workers == 0
    assert wrapper.rebuilt._iterator is None and torch.multiprocessing.get_sharing_strategy() == "file_descriptor"
    kept = rungs.make({"name": "data_path", "options": {"workers": 2, "sharing": "keep"}}).apply(_state(generator=False))
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor" and not any("file_system" in c for c in kept.changes)
    kept.undo()
    with pytest.raises(ValueError, match="sharing"):
        rungs.make({"name": "data_path", "options": {"sharing": "names"}})
    with pytest.raises(ValueError, match="worker_cpus"):
        rungs.make({"name": "data_path", "options": {"worker_cpus": 3}})


def test_check_says_why_not():
    assert "no data source" in DataPathRung().check(TrainState(model=nn.Linear(2, 2), optimizer=None, device=CPU))
    exact = rungs.make({"name": "data_path", "options": {"exact": True}}).check(_state(RandomCrops()))
    assert exact.startswith("nothing to change") and "num_workers kept at 0" in exact and "on a CPU" in exact
    assert "(data_path's exact: true keeps every draw)" in exact
    # by default the draws may change, not the side they are made on: the training process's own draws would move
    reason = DataPathRung().check(_state(RandomCrops()))
    assert reason.startswith("nothing to change") and "num_workers stays 0" in reason, reason
    assert "from the training process's RNGs" in reason and "the next epoch's shuffle" in reason, reason
    kept = rungs.make({"name": "data_path", "options": {"workers": "keep"}}).check(_state(generator=False))
    assert kept.startswith("nothing to change")
    # a RandomSampler with a generator: to workers exactly (the fit reads it through StopAtLength), back to none not
    assert rungs.make({"name": "data_path", "options": {"workers": 2}}).check(_state()) is None
    seeded = rungs.make({"name": "data_path", "options": {"workers": 0}}).check(_state(workers=2))
    assert seeded.startswith("nothing to change") and "num_workers stays above 0" in seeded and "next epoch's shuffle" in seeded
    plain = _state()
    plain.data = BatchSource([(torch.ones(2),)], CPU)
    assert "not a torch DataLoader" in DataPathRung().check(plain)


@pytest.mark.parametrize("workers", [(0, 2), (2, 0), (1, 2)], ids=["0->2", "2->0", "1->2"])
def test_a_distributed_samplers_stream_moves_between_worker_counts_exactly(workers):
    """Lightning's DDP sampler: each rank's shuffle comes from a generator seeded from seed + epoch
    when it is iterated, so any worker count reads the same indices; the rung may change it."""
    from torch.utils.data import DistributedSampler

    def loader(n: int) -> DataLoader:
        sampler = DistributedSampler(Indexed(), num_replicas=2, rank=1, shuffle=True, seed=3)
        return DataLoader(Indexed(), batch_size=4, sampler=sampler, num_workers=n)

    def epochs(dl: DataLoader) -> list[list[int]]:
        torch.manual_seed(123)
        order = []
        for epoch in range(2):
            dl.sampler.set_epoch(epoch)  # as Lightning does before each epoch
            order += [[int(i) for i in batch[0]] for batch in dl]
        return order

    original = loader(workers[0])
    expected = epochs(original)
    clone = rebuild_loader(
        loader(workers[0]),
        num_workers=workers[1],
        pin_memory=False,
        persistent_workers=False,
        prefetch_factor=2 if workers[1] else None,
    )
    assert epochs(clone) == expected and len(expected) == 12 and expected[:6] != expected[6:]
    state = _state()
    state.data = BatchSource(loader(workers[0]), CPU)
    assert rungs.make({"name": "data_path", "options": {"workers": workers[1]}}).check(state) is None


def _mixup(items):
    """A collate_fn that mixes each batch by a draw from the global RNG (torchvision's CutMix/MixUp recipe)."""
    index, x, worker = torch.utils.data.default_collate(items)
    return index, x * torch.rand(()), worker


@pytest.mark.parametrize("workers", [(0, 2), (1, 2), (1, 0)], ids=["0->2", "1->2", "1->0"])
def test_the_worker_count_is_kept_where_the_collate_fn_draws_random_numbers(workers):
    """Workers run the collate_fn too, each from its own seed: another worker count mixes every batch by
    other numbers, which exact mode keeps. Before, only the dataset was probed and the rung changed the count."""
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True, collate_fn=_mixup, num_workers=workers[0])
    state = TrainState(model=nn.Linear(4, 1), optimizer=None, device=CPU, data=BatchSource(loader, CPU))
    reason = rungs.make({"name": "data_path", "options": {"workers": workers[1], "exact": True}}).check(state)
    assert reason.startswith("nothing to change"), reason
    assert (
        f"num_workers kept at {workers[0]}: its collate_fn draws random numbers (calling it draws from the torch RNG)" in reason
    ), reason
    assert worker_dependence(Indexed(), torch.utils.data.default_collate) is None


class OwnGenerators(Indexed):
    """Augments from generators of its own (torch's and NumPy's), not from the process RNGs."""

    def __init__(self) -> None:
        import numpy as np

        super().__init__()
        self.g, self.rng = torch.Generator().manual_seed(0), np.random.default_rng(0)

    def __getitem__(self, i: int):
        index, x, worker = super().__getitem__(i)
        return index, x + torch.rand(4, generator=self.g) + float(self.rng.random()), worker


def test_generators_a_dataset_keeps_of_its_own_are_where_they_were_after_probing_measuring_and_trials():
    """Reading samples here moves a dataset's own generators: the probe, the measurement without workers
    and the trials left them moved, so the user's loop saw other samples even where nothing was changed."""
    dataset = OwnGenerators()
    loader = DataLoader(dataset, batch_size=4, shuffle=True)

    def states():
        return dataset.g.get_state(), dataset.rng.bit_generator.state

    before = states()
    state = TrainState(model=nn.Linear(4, 1), optimizer=None, device=CPU, data=BatchSource(loader, CPU))
    reason = rungs.make({"name": "data_path", "options": {"workers": 2}}).check(state)  # probed
    assert torch.equal(states()[0], before[0]) and states()[1] == before[1]
    assert (
        "num_workers kept at 0: its samples draw random numbers (reading one draws from its own torch.Generator and "
        "its own numpy.Generator)" in reason
    ), reason
    choose_settings(loader, CPU, workers=0, pin_memory=False, max_s=0.05)  # measured, here without workers
    assert torch.equal(states()[0], before[0]) and states()[1] == before[1]
    source = BatchSource(loader, CPU)
    saved = source.state_dict()  # what a snapshot before the trials keeps
    list(source.iterable)
    assert states()[1] != before[1]
    source.load_state_dict(saved)
    assert torch.equal(states()[0], before[0]) and states()[1] == before[1]


@pytest.mark.parametrize(
    "loader, options, why",
    [
        (dict(dataset=Indexed(3), drop_last=True), {}, "the loader is left as it is: data: the train loader yielded no batch"),
        (
            dict(dataset=Indexed(), num_workers=1, timeout=30),
            {"workers": 0},
            "num_workers kept at 1: the loader sets timeout=30, which needs num_workers > 0",
        ),
        (
            dict(dataset=Indexed(), num_workers=1, multiprocessing_context="spawn"),
            {"workers": 0},
            "num_workers kept at 1: the loader names a multiprocessing context, which needs num_workers > 0",
        ),
    ],
    ids=["no-batch", "timeout", "multiprocessing-context"],
)
def test_a_loader_that_cannot_take_the_settings_is_left_as_it_is_with_the_reason(loader, options, why, monkeypatch):
    """A loader whose drop_last leaves no batch, or whose timeout or multiprocessing context a loader
    without workers refuses: check says why, where before it raised (the timeout: torch's AssertionError)."""
    if options:  # the worker candidates are not started: their rate is made up
        monkeypatch.setattr(data_path, "choose_settings", functools.partial(choose_settings, measure=lambda s: 100.0))
    loader = DataLoader(batch_size=4, **loader)
    state = TrainState(model=nn.Linear(4, 1), optimizer=None, device=CPU, data=BatchSource(loader, CPU))
    reason = rungs.make({"name": "data_path", "options": options}).check(state)
    assert reason.startswith("nothing to change") and why in reason and "\n" not in reason, reason
    if loader.timeout:
        with pytest.raises(ConfigError, match="timeout=30, which needs num_workers > 0"):
            rebuild_loader(loader, num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None)


def test_overridden_transfer_hooks_are_found_on_the_module_and_the_datamodule():
    class Hooked(pl.LightningModule):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch

    class Moving(pl.LightningDataModule):
        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            return batch

    assert overridden_transfer_hooks(SimpleNamespace(datamodule=Moving()), Hooked()) == [
        "LightningModule.on_before_batch_transfer",
        "datamodule.transfer_batch_to_device",
    ]
    assert overridden_transfer_hooks(SimpleNamespace(datamodule=None), pl.LightningModule()) == []


# -- a Lightning fit --------------------------------------------------------------------------------

QUICK = {
    "warmup": 1,
    "steps": 2,
    "repeats": 1,
    "parity_steps": 1,
    "min_blocks": 2,
    "max_blocks": 2,
    "settle": 0,
    "budget_s": 60.0,
    "holds_windows": 0,
    "final_check": False,
    "telemetry": False,
}


class Model(pl.LightningModule):
    """A training step that draws from the global RNG, as dropout on a CPU does."""

    def __init__(self, shuffle: str, workers: int, persistent: bool, batch_size: int = 4, drop_last: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.shuffle, self.workers, self.persistent = shuffle, workers, persistent
        self.batch_size, self.drop_last = batch_size, drop_last
        self.generator = torch.Generator().manual_seed(11) if shuffle == "generator" else None

    def training_step(self, batch, batch_idx):
        index, x, worker = batch
        return self.layer(x * torch.rand(())).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(
            Indexed(),
            batch_size=self.batch_size,
            shuffle=True,
            generator=self.generator,
            num_workers=self.workers,
            persistent_workers=self.persistent,
            drop_last=self.drop_last,
        )


class Seen(pl.Callback):
    """What every real training step sees (trial steps run training_step too, never this hook): the
    sample indices, a draw from the global RNG, which workers made each batch (and all of them), and
    the module fitted."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []
        self.draws: list[float] = []
        self.workers: list[list[int]] = []
        self.values: list[list[float]] = []
        self.module: pl.LightningModule | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        index, x, worker = batch
        self.seen.append(index.tolist())
        self.draws.append(torch.rand(()).item())
        self.workers.append(sorted(set(worker.tolist())))
        self.values.append(x.sum(dim=1).tolist())

    def on_fit_end(self, trainer, pl_module):
        self.module = pl_module

    @property
    def made_by(self) -> set[int]:
        return set().union(*map(set, self.workers))


def fit_and_see(make_model: Callable[[], pl.LightningModule], callbacks: list, **trainer_options: Any) -> Seen:
    """Fit ``make_model()`` from seed 0 (on the CPU for 2 epochs, unless ``trainer_options`` say
    otherwise), nothing logged or saved: what its training steps saw."""
    pl.seed_everything(0, verbose=False)
    seen = Seen()
    options = {"accelerator": "cpu", "max_epochs": 2, **trainer_options}
    trainer = pl.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[*callbacks, seen],
        **options,
    )
    trainer.fit(make_model())
    return seen


def force_prefetch(monkeypatch) -> None:
    """Prefetch one batch ahead on the CPU too (the same pull schedule as on CUDA, nothing copied)."""
    make_plan = DataPathRung._make_plan
    monkeypatch.setattr(
        DataPathRung,
        "_make_plan",
        lambda self, *a, **k: dataclasses.replace(make_plan(self, *a, **k), prefetch=True, lookahead=1),
    )


def data_path_ladder(mode: str, workers: int, monkeypatch) -> SpeedLadder:
    """SpeedLadder with the data_path rung at ``workers`` workers: "given" applies it without trials;
    "trials" runs real trials and restores, only the keep decision fixed."""
    spec = {"name": "data_path", "options": {"workers": workers}}
    if mode == "trials":
        monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("kept", "forced by the test"))
        return SpeedLadder(rungs=[spec], trials="always", measure=QUICK)
    return SpeedLadder(rungs=[spec])


def _fit(shuffle: str, workers: int, callbacks, persistent: bool = False, **loader: Any) -> Seen:
    seen = fit_and_see(lambda: Model(shuffle, workers, persistent, **loader), callbacks)
    seen.generator_state = seen.module.generator.get_state() if seen.module.generator is not None else None
    return seen


@pytest.mark.parametrize(
    "mode, shuffle, workers, persistent",
    [
        ("given", "global_rng", (0, 2), False),
        ("trials", "global_rng", (0, 2), False),
        ("given", "global_rng", (2, 0), False),
        ("given", "generator", (1, 2), False),
        ("trials", "generator", (1, 2), True),
        ("trials", "global_rng", (1, 2), True),
    ],
    ids=[
        "given-global-0->2",
        "trials-global-0->2",
        "given-global-2->0",
        "given-generator-1->2",
        "trials-generator-persistent-1->2",
        "trials-global-persistent-1->2",
    ],
)
def test_a_fit_with_data_path_sees_the_same_samples_in_the_same_order(mode, shuffle, workers, persistent, monkeypatch):
    plain = _fit(shuffle, workers[0], [], persistent)
    ladder = data_path_ladder(mode, workers[1], monkeypatch)
    events: list[str] = []
    ladder.on_event = events.append
    fast = _fit(shuffle, workers[0], [ladder], persistent)
    changes = ladder.applied_changes["data_path"]
    assert any("first epoch's iterator made again" in c for c in changes), changes
    assert any(e.startswith("fit: the train loop iterates") for e in events) and not any("fit: fit:" in e for e in events)
    assert len(plain.seen) == 24 and fast.seen == plain.seen  # two epochs, every sample in the same order
    assert fast.draws == plain.draws  # the global RNG stream is where it would be
    assert plain.seen[:12] != plain.seen[12:]
    assert fast.made_by == (set(range(workers[1])) or {-1}) and plain.made_by == (set(range(workers[0])) or {-1})
    assert ladder.handles == []  # undone at teardown


@pytest.mark.parametrize(
    "mode, loader, stops",
    [
        ("given", {}, True),
        ("trials", {}, True),
        ("given", {"batch_size": 5, "drop_last": True}, True),
        ("given", {"batch_size": 5}, False),
    ],
    ids=["given-divides", "trials-divides", "given-drop-last", "given-partial-last-batch"],
)
def test_a_seeded_shuffle_moves_from_no_workers_to_workers_exactly(mode, loader, stops, monkeypatch):
    """``shuffle=True, generator=g`` at 0 workers -> 2 workers: the same samples in the same order over
    two epochs and the generator left where the fit without workers leaves it (its next shuffle)."""
    plain = _fit("generator", 0, [], **loader)
    ladder = data_path_ladder(mode, 2, monkeypatch)
    fast = _fit("generator", 0, [ladder], **loader)
    changes = ladder.applied_changes["data_path"]
    assert any("num_workers=2" in c for c in changes) and fast.made_by == {0, 1}, changes
    assert any("StopAtLength" in c for c in changes) == stops, changes
    per_epoch = len(plain.seen) // 2
    assert fast.seen == plain.seen and plain.seen[:per_epoch] != plain.seen[per_epoch:]
    assert torch.equal(fast.generator_state, plain.generator_state)
    assert fast.draws == plain.draws


class Augmented(Indexed):
    """Draws from its worker's RNG per sample, as augmentations do: with persistent workers, how many
    batches a worker made in one epoch decides what it draws in the next."""

    def __getitem__(self, i: int):
        index, _, worker = super().__getitem__(i)
        return index, torch.rand(4), worker


class AugmentedModel(Model):
    def train_dataloader(self):
        return DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)


@pytest.mark.parametrize("limit, capped", [(3, True), (3, False), (1.0, True)], ids=["cut-capped", "cut-not-capped", "whole"])
def test_persistent_workers_make_and_draw_what_they_would_without_prefetching(limit, capped, monkeypatch):
    """The user's own loader, prefetched, with persistent workers whose samples draw random numbers.
    Cut short (``limit_train_batches``), an epoch takes that many batches and the prefetcher pulls no
    more, so the workers make as many batches as without it and draw the same numbers next epoch.
    The first epoch's iterator, which Lightning made, is prefetched as it is (made again, its
    persistent workers restarted, the fit lost that epoch). Prefetching is forced on the CPU here
    (the same pull schedule, nothing copied)."""
    force_prefetch(monkeypatch)
    if not capped:  # what the fit read before the cap: one batch more per epoch than Lightning took
        monkeypatch.setattr(lightning_data, "epoch_batches", lambda trainer: None)

    def fit(callbacks) -> Seen:
        return fit_and_see(lambda: AugmentedModel("global_rng", 2, True), callbacks, max_epochs=3, limit_train_batches=limit)

    plain = fit([])
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": "keep"}}])
    fast = fit([ladder])
    changes = ladder.applied_changes["data_path"]
    assert any("fit: the train loop iterates" in c for c in changes)
    assert any("first epoch's iterator, which Lightning made, prefetched as it is" in c for c in changes), changes
    assert len(plain.seen) == (9 if limit == 3 else 36) and fast.seen == plain.seen and fast.draws == plain.draws
    assert plain.made_by == fast.made_by == {0, 1}
    assert (fast.values == plain.values) == capped


class EndsEpochsEarly(AugmentedModel):
    """Ends each epoch at its fifth batch (of 12), returning -1 from ``on_train_batch_start``."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 4 else None


@pytest.mark.parametrize("told", [True, False], ids=["pulled-ahead-after-the-hook", "pulled-ahead-at-handout"])
def test_an_epoch_the_module_ends_at_batch_start_leaves_the_persistent_workers_where_they_would_be(told, monkeypatch):
    """``on_train_batch_start`` returning -1 ends the epoch after Lightning fetched that batch and
    before its step. The batch ahead is pulled only once the hook let the step run, so the persistent
    workers make (and draw for) as many batches as without speedkit: the next epochs' augmentations
    are the same. Pulled when the batch is handed out (``told`` False: what the prefetcher did before),
    one batch more per epoch, and the augmentations move. Prefetching is forced on the CPU here."""
    force_prefetch(monkeypatch)
    if not told:
        monkeypatch.setattr(lightning_data, "may_end_epoch_at_batch_start", lambda trainer: False)
    pulls = _Pulls(monkeypatch)

    def fit(callbacks) -> Seen:
        return fit_and_see(lambda: EndsEpochsEarly("global_rng", 2, True), callbacks, max_epochs=3)

    plain = fit([])
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": "keep"}}])
    fast = fit([ladder])
    changes = ladder.applied_changes["data_path"]
    assert any("on_train_batch_start lets the step run" in c for c in changes) == told, changes
    assert len(plain.seen) == 15 and fast.seen == plain.seen and fast.draws == plain.draws  # 5 batches an epoch
    assert pulls.pulled == (15 if told else 18)
    assert (fast.values == plain.values) == told
    assert "on_train_batch_start" not in vars(fast.module)  # the wrapper removed at teardown


def _measured_factor_4_fastest(monkeypatch) -> None:
    """Loader measurements in which prefetch_factor 4 is clearly fastest (the rung's choice made certain)."""

    def measure(s: LoaderSettings) -> float:
        return 100.0 + (20.0 if s.prefetch_factor == 4 else 0.0) + (1.0 if s.pin_memory else 0.0)

    monkeypatch.setattr(data_path, "choose_settings", functools.partial(choose_settings, measure=measure))


@pytest.mark.parametrize("dataset, factor", [(Augmented, 2), (Indexed, 4)], ids=["augmenting", "not-augmenting"])
def test_persistent_workers_keep_their_prefetch_factor_where_samples_draw_random_numbers(dataset, factor, monkeypatch):
    """Exact mode. Persistent workers carry what they drew into the next epoch, including for the batches they made
    ahead of an epoch that ended early: where samples draw random numbers, the factor measured fastest
    (4) would change later augmentations, so the loader's own (2) is kept and the note says why."""
    _measured_factor_4_fastest(monkeypatch)
    loader = DataLoader(dataset(), batch_size=4, num_workers=2, persistent_workers=True)
    options = data_path.DataPathOptions(workers="keep", pin_memory=True, exact=True)
    plan = DataPathRung(options)._make_plan(BatchSource(loader, CPU), CPU)
    assert plan.rebuild is not None and plan.rebuild.pin_memory and plan.rebuild.prefetch_factor == factor
    kept = [
        n
        for n in plan.notes
        if n.startswith("prefetch_factor kept at 2: the loader's workers are persistent and its samples draw random numbers")
    ]
    assert len(kept) == (factor == 2), plan.notes
    assert {s.prefetch_factor for s, _ in plan.choice.rates} == ({2} if factor == 2 else {2, 4})


def test_a_cut_epoch_of_persistent_augmenting_workers_moves_later_draws_with_another_prefetch_factor():
    """Why the factor is kept: an epoch broken off after 3 batches leaves prefetch_factor batches per
    worker made ahead and dropped; the next epoch's augmentations are the same only with the same factor."""

    def epochs(factor: int) -> list[list[float]]:
        loader = rebuild_loader(
            DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True),
            num_workers=2,
            pin_memory=False,
            persistent_workers=True,
            prefetch_factor=factor,
        )
        torch.manual_seed(3)
        values = []
        for cut in (3, None):
            for i, (_, x, _) in enumerate(loader):
                if i == cut:
                    break
                values.append(x.sum(dim=1).tolist())
        compat.shutdown_workers(loader)
        return values

    by_two, again, by_four = epochs(2), epochs(2), epochs(4)
    assert len(by_two) == 3 + 12 and by_two == again
    assert by_four[:3] == by_two[:3] and by_four[3:] != by_two[3:]


def test_a_fit_with_cut_epochs_sees_the_augmentations_it_would_after_a_rebuild_measured_faster_at_another_factor(monkeypatch):
    """Exact mode: the rung rebuilds a persistent, augmenting loader (pinned, asked for) where prefetch_factor 4
    measures fastest; with epochs cut by ``limit_train_batches`` the fit still sees every sample, draw
    and augmentation it sees without speedkit (prefetching forced on the CPU: the same pull schedule)."""
    force_prefetch(monkeypatch)
    _measured_factor_4_fastest(monkeypatch)

    def fit(callbacks) -> Seen:
        return fit_and_see(lambda: AugmentedModel("global_rng", 2, True), callbacks, max_epochs=3, limit_train_batches=3)

    plain = fit([])
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": "keep", "pin_memory": True, "exact": True}}])
    fast = fit([ladder])
    assert len(plain.seen) == 9 and fast.seen == plain.seen and fast.draws == plain.draws
    assert fast.values == plain.values and fast.made_by == {0, 1}
    changes = ladder.applied_changes["data_path"]
    assert any("prefetch_factor=2" in c and "pin_memory=True" in c for c in changes), changes
    assert any(c.startswith("note: prefetch_factor kept at 2") for c in changes), changes


class _Pulls:
    """Counts the host batches every DevicePrefetcher made during a test pulls."""

    def __init__(self, monkeypatch) -> None:
        self.made: list[DevicePrefetcher] = []
        init = DevicePrefetcher.__init__

        def counting(prefetcher, *args, **kwargs):
            init(prefetcher, *args, **kwargs)
            self.made.append(prefetcher)

        monkeypatch.setattr(DevicePrefetcher, "__init__", counting)

    @property
    def pulled(self) -> int:
        return sum(p.pulled for p in self.made)


@pytest.mark.parametrize(
    "every, workers, model",
    [(1, "keep", "persistent-augmented"), (2, 2, "no-workers"), (1, 2, "no-workers"), (1, 2, "persistent-1-worker")],
    ids=[
        "every-epoch-prefetched-persistent",
        "every-2-epochs-0->2-workers",
        "every-epoch-0->2-workers",
        "every-epoch-persistent-1->2-workers",
    ],
)
def test_a_fit_that_reloads_its_train_loader_is_served_after_each_reload(every, workers, model, monkeypatch):
    """``reload_dataloaders_every_n_epochs``: Lightning makes a new train loader at those epochs'
    start. Each is served like the first (rebuilt, prefetched), every batch of every epoch
    prefetched, and the fit sees what it sees without speedkit (samples, draws, augmentations).
    Before, the fit iterated the reloaded loaders as Lightning made them, unprefetched, its report
    still saying the train loop iterated the rebuilt loader."""
    force_prefetch(monkeypatch)
    pulls = _Pulls(monkeypatch)
    epochs = 5
    make_model = {
        "persistent-augmented": lambda: AugmentedModel("global_rng", 2, True),
        "no-workers": lambda: Model("global_rng", 0, False),
        "persistent-1-worker": lambda: Model("global_rng", 1, True),
    }[model]

    def fit(callbacks) -> Seen:
        return fit_and_see(make_model, callbacks, max_epochs=epochs, reload_dataloaders_every_n_epochs=every)

    plain = fit([])
    assert not pulls.made
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": workers}}])
    fast = fit([ladder])
    per_epoch = len(plain.seen) // epochs
    assert per_epoch == 12
    assert fast.seen == plain.seen and fast.draws == plain.draws and fast.values == plain.values
    assert pulls.pulled == len(plain.seen)  # every batch of every epoch prefetched, none beyond
    changes = ladder.applied_changes["data_path"]
    assert any(
        "each train loader the fit reloads (reload_dataloaders_every_n_epochs) is served the same way" in c for c in changes
    ), changes
    if workers == 2:  # every epoch made by the rebuilt copy's workers, reloads included
        for e in range(epochs):
            made_by = set().union(*map(set, fast.workers[e * per_epoch : (e + 1) * per_epoch]))
            assert made_by == {0, 1}, (e, made_by)
    assert ladder.handles == []


def test_a_reloaded_train_loader_that_cannot_be_served_is_iterated_as_lightning_made_it(monkeypatch):
    """Serving a reloaded loader fails: the fit goes on, on the loader Lightning made, and says why."""
    serve = DataPathFit._serve
    calls = []

    def failing(self, trainer, original):
        calls.append(original)
        if len(calls) > 1:
            raise RuntimeError("no room")
        return serve(self, trainer, original)

    monkeypatch.setattr(DataPathFit, "_serve", failing)

    def fit(callbacks) -> Seen:
        return fit_and_see(lambda: Model("global_rng", 0, False), callbacks, max_epochs=3, reload_dataloaders_every_n_epochs=1)

    plain = fit([])
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": 2}}])
    with pytest.warns(UserWarning, match="serving the reloaded train loader failed"):
        fast = fit([ladder])
    assert fast.seen == plain.seen and fast.draws == plain.draws and len(plain.seen) == 36
    assert any(
        "serving the reloaded train loader failed (RuntimeError: no room)" in c for c in ladder.applied_changes["data_path"]
    )
    assert fast.made_by == {-1, 0, 1} and ladder.handles == []


def test_stop_at_length_reads_no_further_than_the_sampler_length():
    from torch.utils.data import RandomSampler

    from speedkit.data.settings import StopAtLength, needs_stop_at_length, reads_sampler_to_its_end

    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    wrapped, plain = StopAtLength(RandomSampler(range(10), generator=g1)), RandomSampler(range(10), generator=g2)
    it = iter(plain)
    first = [next(it) for _ in range(10)]
    assert list(wrapped) == first and len(wrapped) == 10 and wrapped.generator is g1
    assert torch.equal(g1.get_state(), g2.get_state())  # the plain one was not asked for an 11th index either
    assert list(it) == [] and not torch.equal(g1.get_state(), g2.get_state())  # read to its end, it draws once more
    seeded = _loader("generator")  # 48 samples, batches of 4
    assert not reads_sampler_to_its_end(seeded) and needs_stop_at_length(seeded, 2) and not needs_stop_at_length(seeded, 0)
    partial = DataLoader(Indexed(), batch_size=5, shuffle=True, generator=torch.Generator())
    assert reads_sampler_to_its_end(partial) and not needs_stop_at_length(partial, 2)
    rebuilt = rebuild_loader(
        seeded, num_workers=2, pin_memory=False, persistent_workers=False, prefetch_factor=2, stop_at_length=True
    )
    assert isinstance(rebuilt.sampler, StopAtLength) and rebuilt.sampler.sampler is seeded.sampler
    assert rebuilt.batch_sampler.batch_size == 4 and len(rebuilt) == len(seeded) == 12
    assert seeded.sampler is not rebuilt.sampler and seeded.batch_sampler.sampler is seeded.sampler  # the user's untouched


def test_worker_counts_leave_two_cores_to_the_training_process():
    from speedkit.data.choose import worker_counts

    assert worker_counts(0, 16) == [0, 2, 4, 8, 14]
    assert worker_counts(4, 8) == [4, 2, 6]
    assert worker_counts(0, 2) == [0]
    assert worker_counts(1, 3) == [1]


# -- keeping workers off the training process's cores ------------------------------------------------


def test_cpu_lists_parse_and_format_as_linux_writes_them():
    from speedkit.data.topology import format_cpu_list, parse_cpu_list

    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpu_list({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    assert format_cpu_list([5]) == "5" and parse_cpu_list("") == set()


def test_training_cpus_keep_the_core_issuing_the_step_and_one_more_with_their_hyperthreads():
    from speedkit.data.topology import training_cpus

    allowed = set(range(16))
    kept, rest = training_cpus(allowed=allowed, here=5, siblings=lambda c: {c % 8, c % 8 + 8})
    assert kept == {5, 13, 0, 8} and rest == allowed - kept
    kept, rest = training_cpus(allowed=allowed, here=5, siblings=lambda c: {c})  # no hyperthreads shown
    assert kept == {5, 0} and len(rest) == 14
    kept, rest = training_cpus(allowed={0, 1, 2}, here=1, siblings=lambda c: {c})  # one CPU would be left: none kept
    assert kept == set() and rest == {0, 1, 2}
    kept, rest = training_cpus(allowed={2, 3, 4, 5}, here=9, siblings=lambda c: {c})  # here outside the affinity
    assert kept == {2, 3} and rest == {4, 5}


def test_ddp_ranks_on_one_machine_each_keep_their_own_share_and_no_worker_runs_on_another_ranks_cores():
    from speedkit.data.topology import host_share, physical_cores, training_cpus

    allowed, ht = set(range(16)), (lambda c: {c % 8, c % 8 + 8})  # 8 cores, CPU c and c + 8 share one
    assert physical_cores(allowed, ht)[:2] == [{0, 8}, {1, 9}]
    shares = [host_share(allowed, r, 3, ht) for r in range(3)]  # 8 cores for 3 ranks: 3, 3, 2
    assert shares == [{0, 8, 1, 9, 2, 10}, {3, 11, 4, 12, 5, 13}, {6, 14, 7, 15}]
    splits = [
        training_cpus(allowed=allowed, here=h, siblings=ht, processes=(r, 2), machine=allowed) for r, h in ((0, 9), (1, 3))
    ]  # rank 1's thread happens to run in rank 0's share
    (kept0, rest0), (kept1, rest1) = splits
    assert kept0 == {1, 9, 0, 8} and rest0 == {2, 10, 3, 11}
    assert kept1 == {4, 12, 5, 13} and rest1 == {6, 14, 7, 15}
    assert not (kept0 | rest0) & (kept1 | rest1)
    # a launcher already pinned each rank to its CPUs: they are split as they are
    kept, rest = training_cpus(allowed={4, 5, 6, 7}, here=4, siblings=lambda c: {c}, processes=(1, 2), machine=allowed)
    assert kept == {4, 5} and rest == {6, 7}
    # more ranks than cores: every rank shares them all
    assert host_share({0, 1}, 1, 4, lambda c: {c}) == {0, 1}
    assert training_cpus(allowed=allowed, here=0, siblings=ht, processes=(0, 1)) == training_cpus(
        allowed=allowed, here=0, siblings=ht
    )


def test_the_steps_say_how_many_training_processes_share_the_machine(monkeypatch):
    from speedkit.training.step import PlainStep, StepWrapper, local_processes_from_env

    assert local_processes_from_env({}) == (0, 1)
    assert local_processes_from_env({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}) == (1, 4)
    assert local_processes_from_env({"LOCAL_RANK": "1"}) == (0, 1)  # a rank without a count: as one process
    assert local_processes_from_env({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "2"}) == (0, 1)
    model = torch.nn.Linear(2, 1)
    step = PlainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert step.host_processes() == (0, 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's
    assert step.host_processes() == (1, 2) and StepWrapper(step).host_processes() == (1, 2)


class Affinities(Dataset):
    """Sample i: i, and the CPUs the process making it may run on."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, list[int]]:
        import os

        return i, sorted(os.sched_getaffinity(0))


def _note_worker(worker_id: int) -> None:
    torch.manual_seed(1000 + worker_id)  # a user's worker_init_fn, run after the affinity is set


def test_rebuilt_workers_run_on_the_cpus_given_and_still_call_the_loaders_worker_init_fn():
    import os
    import pickle

    from speedkit.data.topology import WorkerAffinity

    one = (min(os.sched_getaffinity(0)),)
    loader = DataLoader(Affinities(), batch_size=None, num_workers=0, worker_init_fn=_note_worker)
    rebuilt = rebuild_loader(
        loader, num_workers=2, pin_memory=False, persistent_workers=False, prefetch_factor=2, worker_cpus=one
    )
    assert isinstance(rebuilt.worker_init_fn, WorkerAffinity) and rebuilt.worker_init_fn.then is _note_worker
    assert loader.worker_init_fn is _note_worker  # the user's loader untouched
    assert LoaderSettings.of(rebuilt) == LoaderSettings(2, False, False, 2, one)
    assert [(i, cpus) for i, cpus in rebuilt] == [(i, list(one)) for i in range(8)]
    again = rebuild_loader(rebuilt, num_workers=2, pin_memory=False, persistent_workers=False, prefetch_factor=2)
    assert again.worker_init_fn is _note_worker  # rebuilt without CPUs: the loader's own function, unwrapped
    assert (
        rebuild_loader(
            rebuilt, num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None, worker_cpus=one
        ).worker_init_fn
        is _note_worker
    )  # no workers to keep
    restored = pickle.loads(pickle.dumps(rebuilt.worker_init_fn))  # a spawn context pickles it
    assert restored.cpus == one and restored.then is _note_worker
    seen = []
    WorkerAffinity(tuple(sorted(os.sched_getaffinity(0))), seen.append)(3)
    assert seen == [3]


def test_choose_settings_puts_every_worker_candidate_on_the_cpus_given_and_tries_no_more_workers_than_cpus():
    tried = []

    def measure(s: LoaderSettings) -> float:
        tried.append(s)
        return 10.0 + s.num_workers

    loader = _loader("none")
    choice = choose_settings(loader, torch.device("cpu"), measure=measure, cpus=16, worker_cpus=(4, 5, 6, 7, 8, 9))
    assert {s.num_workers for s in tried} == {0, 2, 4, 6}
    assert all(s.worker_cpus == (4, 5, 6, 7, 8, 9) for s in tried if s.num_workers > 0)
    assert all(s.worker_cpus is None for s in tried if s.num_workers == 0)
    assert choice.settings.num_workers == 6 and "workers on CPUs 4-9" in choice.settings.describe()


def test_the_threads_a_loader_iterator_starts_here_go_to_the_cpus_its_workers_were_kept_off():
    import os
    import threading

    from speedkit.data.topology import iterate_with_threads_kept

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    other = DataLoader(list(range(40)), batch_size=4, num_workers=1)
    other_it = iter(other)  # another loader's feeder thread, started before: left where it is
    loader = DataLoader(list(range(40)), batch_size=4, num_workers=1)
    rebuilt = rebuild_loader(
        loader, num_workers=1, pin_memory=False, persistent_workers=False, prefetch_factor=2, worker_cpus=(cpus[-1],)
    )
    before = {t.native_id for t in threading.enumerate()}
    it = iterate_with_threads_kept(rebuilt)
    new = [t for t in threading.enumerate() if t.native_id not in before and t.name == "QueueFeederThread"]
    assert new and all(os.sched_getaffinity(t.native_id) == set(cpus[:-1]) for t in new)
    old = [t for t in threading.enumerate() if t.native_id in before and t.name == "QueueFeederThread"]
    assert old and all(os.sched_getaffinity(t.native_id) == set(cpus) for t in old)
    assert [b.tolist() for b in it] == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    del other_it


def test_a_lightning_step_counts_the_trainers_processes_on_this_machine():
    from types import SimpleNamespace

    from speedkit.lightning.step import LightningStep

    ddp = SimpleNamespace(trainer=SimpleNamespace(world_size=4, local_rank=1, num_devices=2))  # 2 machines x 2 GPUs
    assert LightningStep.host_processes(ddp) == (1, 2)  # type: ignore[arg-type]
    single = SimpleNamespace(trainer=SimpleNamespace(world_size=1, local_rank=0, num_devices=1))
    assert LightningStep.host_processes(single) == (0, 1)  # type: ignore[arg-type]


def test_under_ddp_the_rung_plans_workers_within_its_ranks_share(monkeypatch):
    import speedkit.rungs.data_path as data_path_module
    from speedkit.data.choose import Choice
    from speedkit.data.settings import LoaderSettings

    seen = {}

    def fake_training_cpus(*, processes=(0, 1)):
        seen["processes"] = processes
        return ({0, 1}, {2, 3, 4, 5}) if seen.get("keep") else (set(), set(range(8)))  # none kept: the rank's share

    def fake_choose(loader, device, **kwargs):
        seen.update(kwargs)
        current = LoaderSettings.of(loader)
        return Choice(current, current, [(current, 1.0)], [])

    monkeypatch.setattr(data_path_module, "training_cpus", fake_training_cpus)
    monkeypatch.setattr(data_path_module, "choose_settings", fake_choose)
    state = _state(generator=False)
    state.step = SimpleNamespace(host_processes=lambda: (1, 2))
    DataPathRung().check(state)
    assert seen["processes"] == (1, 2) and seen["cpus"] == 8 and seen["worker_cpus"] is None  # none kept: half the CPUs
    seen.clear()
    seen["keep"] = True
    DataPathRung().check(state)
    assert seen["worker_cpus"] == (2, 3, 4, 5) and seen["cpus"] is None  # the workers' CPUs bound the count


def test_mappings_that_are_no_dict_are_batches_too():
    """transformers' DataCollatorWithPadding returns a BatchEncoding (a UserDict): its tensors are
    counted, copied and moved like a dict's, and it stays a BatchEncoding (its encodings with it)."""
    from transformers import BatchEncoding

    from speedkit.data.batch import count_items, host_copy, move_to_device, same_batch

    batch = BatchEncoding({"input_ids": torch.ones(4, 7, dtype=torch.long), "attention_mask": torch.ones(4, 7, dtype=torch.long)})
    assert count_items(batch) == (28, "tokens/s")
    copied = host_copy(batch)
    assert type(copied) is BatchEncoding and copied is not batch
    assert copied["input_ids"] is not batch["input_ids"] and torch.equal(copied["input_ids"], batch["input_ids"])
    assert same_batch(copied, batch) and not same_batch(copied, BatchEncoding({**batch, "input_ids": batch["input_ids"] + 1}))
    moved = move_to_device(batch, torch.device("cpu"))
    assert type(moved) is BatchEncoding and set(moved) == {"input_ids", "attention_mask"}


def test_settings_chosen_by_measuring_are_reused_by_a_cached_decision_where_the_loader_is_as_it_was(monkeypatch):
    """A kept data_path says what it chose (``chosen``); a later rung told it (``reuse``) applies the same
    without measuring, once; a loader whose settings changed since, or a choice this plan may not make
    (a worker count the rung's options fix otherwise), is measured as usual."""
    import speedkit.rungs.data_path as data_path_module
    from speedkit.data.settings import LoaderSettings

    measured = []

    def measure(s):  # 2 workers the fastest count, buffering 4 batches each faster still
        measured.append(s)
        return {(2, 2): 50.0, (2, 4): 60.0}.get((s.num_workers, s.prefetch_factor), 10.0 + s.num_workers)

    monkeypatch.setattr(data_path_module, "training_cpus", lambda *, processes=(0, 1): (set(), set(range(8))))
    monkeypatch.setattr(data_path_module, "choose_settings", functools.partial(choose_settings, measure=measure))
    first = DataPathRung()
    handle = first.apply(_state(generator=False))
    chosen = first.chosen()
    handle.undo()
    assert measured and chosen == {
        "current": {"num_workers": 0, "pin_memory": False, "persistent_workers": False, "prefetch_factor": None},
        "settings": {"num_workers": 2, "pin_memory": False, "persistent_workers": False, "prefetch_factor": 4},
        "batch_bytes": None,
    }
    count = len(measured)
    again = DataPathRung()
    again.reuse(chosen)
    state = _state(generator=False)
    handle = again.apply(state)
    plan = again.plan(state)
    assert len(measured) == count and plan.rebuild == LoaderSettings(2, False, False, 4, None)
    assert any("not measured again" in line for line in handle.changes), handle.changes
    assert again.chosen() == chosen  # a decision made again from it keeps the same
    handle.undo()
    changed = DataPathRung()  # the user's loader has a worker since: measured again
    changed.reuse(chosen)
    changed.check(_state(workers=1, generator=False))
    assert len(measured) > count
    count = len(measured)
    fixed = DataPathRung(data_path_module.DataPathOptions(workers=3))  # options that exclude the cached count
    fixed.reuse(chosen)
    fixed.check(_state(generator=False))
    assert len(measured) > count


# -- the data-bound class as users write it: augmentations drawn from the global RNG ----------------------------


class Augmenting(Dataset):
    """As a torchvision user writes a dataset: a fixed picture per index, augmented by draws from the global torch
    RNG (a flip half the time, then noise: no per-sample seed), and its label."""

    def __init__(self, n: int = 48) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.arange(4, dtype=torch.float32) + i
        if torch.rand(()) < 0.5:
            x = x.flip(0)
        return x + torch.rand(4), i % 5


class LabelsByWorker(Augmenting):
    """The same, its label moved by the worker that made it: what another worker count must not do."""

    def __getitem__(self, i: int):
        x, label = super().__getitem__(i)
        info = get_worker_info()
        return x, label + (info.id + 1 if info is not None else 0)


def _augmenting_loader(workers: int = 2, dataset: Dataset | None = None, **kw: Any) -> DataLoader:
    kw.setdefault("batch_size", 4)
    return DataLoader(dataset if dataset is not None else Augmenting(), shuffle=True, num_workers=workers, **kw)


def _more_workers_pay(monkeypatch, cpus: int = 10) -> list[LoaderSettings]:
    """Loader paces in which more workers pay up to 6 (batches/s: 100 per worker), and ``cpus`` CPUs of which two
    stay with the training process; the candidates measured are returned as they are asked for."""
    asked: list[LoaderSettings] = []

    def measure(s: LoaderSettings) -> float:
        asked.append(s)
        return 100.0 * max(1, min(s.num_workers, 6))

    monkeypatch.setattr(data_path, "choose_settings", functools.partial(choose_settings, measure=measure))
    monkeypatch.setattr(data_path, "training_cpus", lambda processes: ({0, 1}, set(range(2, cpus))))
    return asked


def test_more_workers_for_a_dataset_augmenting_from_the_global_rng_and_the_report_says_which_draws_change(monkeypatch):
    """The default: another worker count changes the augmentations' draws (each worker's own stream), not the order,
    labels or distributions; the measured pace and the CPUs left to workers decide the count (8 of 10 CPUs here)."""
    asked = _more_workers_pay(monkeypatch)
    dependence = worker_dependence(Augmenting())
    assert dependence.draws == ("torch",) and dependence.worker_seeded
    state = TrainState(model=nn.Linear(4, 1), optimizer=None, device=CPU, data=BatchSource(_augmenting_loader(), CPU))
    rung = DataPathRung()
    assert rung.check(state) is None
    plan = rung.plan(state)
    assert plan.rebuild == LoaderSettings(8, False, False, 2, tuple(range(2, 10))) and plan.draws_change
    # the loader's own settings, then 2, 4, 8 workers on the CPUs left to them, then 8 at prefetch_factor 4
    assert [s.num_workers for s in asked] == [2, 2, 4, 8, 8] and asked[-1].prefetch_factor == 4
    handle = rung.apply(state)
    try:
        draws = [c for c in handle.changes if c.startswith("draws that change")]
        assert len(draws) == 1, handle.changes
        assert "what the samples draw from the torch RNG (augmentations" in draws[0]
        assert "8 workers draw other numbers than 2 did" in draws[0]
        assert "Unchanged: the sample order, the labels and the distributions drawn from" in draws[0]
        assert "exact: true keeps every draw" in draws[0]
    finally:
        handle.undo()
    # exact: true keeps the count, and every draw
    exact = DataPathRung(data_path.DataPathOptions(exact=True))
    reason = exact.check(
        TrainState(model=nn.Linear(4, 1), optimizer=None, device=CPU, data=BatchSource(_augmenting_loader(), CPU))
    )
    assert reason.startswith("nothing to change") and "num_workers kept at 2: its samples draw random numbers" in reason, reason


def test_draws_every_worker_copies_alike_or_in_an_iterable_keep_the_worker_count_by_default(monkeypatch):
    """Only draws from the RNGs each worker seeds itself may change: a dataset's own generator is copied into every
    worker, which then draw alike (another distribution of augmentations), and an IterableDataset is split by worker."""
    _more_workers_pay(monkeypatch)
    for dataset, why in ((OwnGenerators(), "its own torch.Generator"), (Stream(), "an IterableDataset")):
        dependence = worker_dependence(dataset)
        assert not dependence.worker_seeded
        loader = DataLoader(dataset, batch_size=4, num_workers=2)
        plan = DataPathRung()._make_plan(BatchSource(loader, CPU), CPU)
        assert plan.rebuild is None and any(n.startswith("num_workers kept at 2") and why in n for n in plan.notes), plan.notes


def test_the_batches_parity_of_another_worker_count_compares_indices_labels_shapes_and_dtypes():
    """2 -> 4 workers of a dataset augmenting from the global RNG: the same indices in the same order, the same
    labels, shapes and dtypes, the augmented values not compared (they differ); the RNGs are put back."""
    from speedkit.data.parity import compare_loaders, read_with_indices

    loader = _augmenting_loader(2)
    more = rebuild_loader(loader, num_workers=4, pin_memory=False, persistent_workers=False, prefetch_factor=2)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    parity = compare_loaders(loader, more, 3)
    assert torch.equal(torch.get_rng_state(), before)
    assert parity.passed and parity.failure is None and parity.batches == 3
    assert parity.compared == (
        "the sample indices of each batch, in order",
        "the values of batch[1]",
        "every leaf's shape and dtype",
    )
    assert parity.not_compared == ("batch[0]",)
    lines = parity.lines()
    assert "over the first 3 batches from the same RNG state, the same: the sample indices" in lines[0]
    assert lines[1].startswith("not compared: the values of batch[0] (the augmented samples")
    # what was not compared did change: each worker count draws its own augmentations
    torch.manual_seed(3)
    two = read_with_indices(loader, 3)
    torch.manual_seed(3)
    four = read_with_indices(more, 3)
    assert [i for i, _ in two] == [i for i, _ in four] and all(torch.equal(a[1], b[1]) for (_, a), (_, b) in zip(two, four))
    assert not all(torch.equal(a[0], b[0]) for (_, a), (_, b) in zip(two, four))


@pytest.mark.parametrize(
    "candidate, difference",
    [
        (lambda: _augmenting_loader(4, generator=torch.Generator().manual_seed(1)), "batch 0: sample indices"),
        (lambda: _augmenting_loader(4, dataset=LabelsByWorker()), "the values of batch[1] differ"),
        (lambda: _augmenting_loader(4, batch_size=2), "batch 0: sample indices"),
        (
            lambda: _augmenting_loader(4, collate_fn=lambda items: [t.double() for t in torch.utils.data.default_collate(items)]),
            "batch[0] is torch.float64 (4, 4) against torch.float32 (4, 4)",
        ),
    ],
    ids=["order", "label", "batch-size", "dtype"],
)
def test_the_batches_parity_fails_where_the_order_a_label_a_shape_or_a_dtype_changes(candidate, difference):
    from speedkit.data.parity import compare_loaders

    parity = compare_loaders(_augmenting_loader(2), candidate(), 3)
    assert not parity.passed and difference in parity.difference, parity.difference
    assert parity.failure.startswith("the batches differ where another worker count must leave them as they were")
    assert "NOT the same" in parity.lines()[0]


class AugmentingModel(Model):
    """The fit of a dataset augmenting from the global RNG, its loader with 2 workers."""

    def training_step(self, batch, batch_idx):
        x, label = batch
        return self.layer(x).pow(2).mean() + 0.0 * label.sum()

    def train_dataloader(self):
        return _augmenting_loader(2)


@pytest.mark.parametrize("same", [True, False], ids=["batches-hold", "a-label-moved"])
def test_the_ladder_judges_a_change_of_the_draws_on_the_batches_parity(same, monkeypatch):
    """The trials' loss trajectories run on parity batches drawn once: for data_path's new worker count the ladder
    judges what must not change on the loaders themselves, says what it compared and what not, and reverts the
    change where a label moved (the loader's parity, not the loss, says why)."""
    from speedkit.data import parity as batch_parity

    monkeypatch.setattr(data_path, "choose_settings", functools.partial(choose_settings, measure=lambda s: 100.0 * s.num_workers))
    monkeypatch.setattr("speedkit.engine.comparison.decide", lambda cfg, paired, *rest: ("kept", "forced by the test"))
    if not same:  # the rebuilt loader's batches compared as those of one whose labels move with the worker
        compare = batch_parity.compare_loaders
        moved = lambda reference, candidate, n: compare(reference, _augmenting_loader(4, dataset=LabelsByWorker()), n)  # noqa: E731
        monkeypatch.setattr(data_path, "compare_loaders", moved)
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": 4}}], trials="always", measure=QUICK)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ladder],
    )
    trainer.fit(AugmentingModel("global_rng", 2, False))
    entry = next(r for r in ladder.result.rungs if r.name == "data_path")
    notes = [c for c in entry.changes if c.startswith("note: the batches' parity")]
    assert len(notes) == 1 and any(c.startswith("draws that change") for c in entry.changes), entry.changes
    assert any(c.startswith("note: not compared: the values of batch[0]") for c in entry.changes)
    if same:
        assert entry.status == "kept" and entry.parity.passed, entry.reason
    else:
        assert entry.status == "reverted" and not entry.parity.passed
        assert entry.reason.startswith("the batches differ where another worker count must leave them as they were")
        assert "the values of batch[1] differ" in entry.reason


class AugmentingWithIndex(Augmenting):
    """The same, each sample also carrying its index (what a fit's order is read from)."""

    def __getitem__(self, i: int):
        x, label = super().__getitem__(i)
        return x, label, i


class AugmentingFit(AugmentingModel):
    def training_step(self, batch, batch_idx):
        x, label, index = batch
        return self.layer(x).pow(2).mean() + 0.0 * label.sum()

    def train_dataloader(self):
        return _augmenting_loader(2, dataset=AugmentingWithIndex())


class SeenAugmented(pl.Callback):
    def __init__(self) -> None:
        self.indices, self.labels, self.values, self.draws = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, label, index = batch
        self.indices.append(index.tolist())
        self.labels.append(label.tolist())
        self.values.append(x.sum(dim=1).tolist())
        self.draws.append(torch.rand(()).item())  # the training process's own stream


def test_a_fit_with_more_workers_for_augmentations_sees_the_same_samples_in_order_with_other_augmentations(monkeypatch):
    """The default data_path on a global-RNG dataset, 2 -> 4 workers, in a fit of two epochs: every index in the same
    order, every label, the training process's own draws as without speedkit; the augmented values differ."""
    _more_workers_pay(monkeypatch)

    def fit(callbacks):
        pl.seed_everything(0, verbose=False)
        seen = SeenAugmented()
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*callbacks, seen],
        )
        trainer.fit(AugmentingFit("global_rng", 2, False))
        return seen

    plain = fit([])
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": 4}}])
    fast = fit([ladder])
    changes = ladder.applied_changes["data_path"]
    assert any("num_workers=4" in c for c in changes) and any(c.startswith("draws that change") for c in changes), changes
    assert len(plain.indices) == 24 and fast.indices == plain.indices and plain.indices[:12] != plain.indices[12:]
    assert fast.labels == plain.labels and fast.draws == plain.draws
    assert fast.values != plain.values  # the augmentations: each of 4 workers draws from its own stream


class WorkerView(Dataset):
    """Each sample: what the worker that made it inherited from the training process (its CPUs, niceness, intra-op
    threads, torch's sharing strategy, Python's profile and trace hooks, the collector's thresholds)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import gc
        import sys

        return (
            tuple(sorted(os.sched_getaffinity(0))),
            os.nice(0),
            torch.get_num_threads(),
            torch.multiprocessing.get_sharing_strategy(),
            sys.getprofile() is None and sys.gettrace() is None,
            gc.get_threshold(),
        )


def _children() -> set[int]:
    """The processes whose parent is this one."""
    from pathlib import Path

    me, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                found.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return found


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc"), reason="Linux")
def test_after_the_trials_a_loader_worker_inherits_what_it_did_before_and_no_process_of_theirs_is_left(monkeypatch):
    """What the user's unchanged loader runs with after SpeedLadder's trials (data_path among them, with 4 workers
    for 2, named shared memory while it is on): its workers inherit the CPUs, niceness, thread count, sharing
    strategy and hooks a worker forked before the trials did, and no worker or other process the trials started
    is left running beside the fit."""
    loader = DataLoader(WorkerView(), batch_size=None, num_workers=2)
    before_children, before = _children(), {repr(s) for s in loader}
    monkeypatch.setattr(data_path, "choose_settings", functools.partial(choose_settings, measure=lambda s: 100.0 * s.num_workers))
    ladder = SpeedLadder(rungs=[{"name": "data_path", "options": {"workers": 4}}], trials="always", measure=QUICK)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ladder],
    )
    trainer.fit(AugmentingModel("global_rng", 2, False))
    assert any(r.name == "data_path" and r.status != "failed" for r in ladder.result.rungs)
    assert _children() <= before_children
    assert {repr(s) for s in loader} == before and len(before) == 1
    assert _children() <= before_children
