"""The batch-size sweep's search (speedkit.engine.sweep) on synthetic throughput and memory curves: the
choice is within 5% of the best an exhaustive sweep of the same sizes finds, in at most 8 trials,
and never a size that runs out of memory or leaves less than the margin free; a size other than the
user's only where shown faster (an undecided comparison keeps the user's). Each size is timed after
its compile and the warm-up after it (a fake compile cost on a virtual time line), and ``speedkit
sweep`` runs on a recipe."""

from __future__ import annotations

import random

import pytest
import torch

from speedkit.engine.sweep import SweepResult, SweepTrial, candidates, checkpointing_where_needed, compare_sizes, sweep
from speedkit.errors import ConfigError

GB = 10**9


def timed(size: int, rates: list[float], peak: int | None = None, accumulate: int = 1) -> SweepTrial:
    """A trial that fit, timed in windows of these throughputs (its median the trial's)."""
    import statistics

    return SweepTrial(size, accumulate, statistics.median(rates), "samples/s", peak, True, window_rates=tuple(rates))


class Curve:
    """Throughput rising to a plateau (a GPU filling up), past ``drop_at`` falling again (caches, the
    allocator); memory a base plus a cost per sample; out of memory past the device's ``memory``."""

    def __init__(self, rng: random.Random, memory: int = 80 * GB) -> None:
        self.half = rng.uniform(2, 200)
        self.peak = rng.uniform(1e3, 1e6)
        self.drop_at = rng.choice([None, rng.uniform(16, 2048)])
        self.base = rng.uniform(1, 30) * GB
        self.per_sample = rng.uniform(0.005, 3) * GB
        self.memory = memory
        self.noise = rng.uniform(0, 0.01)
        self.rng = rng
        self.calls: list[int] = []

    def throughput(self, size: int) -> float:
        rate = self.peak * size / (size + self.half)
        if self.drop_at is not None and size > self.drop_at:
            rate *= (self.drop_at / size) ** 0.3
        return rate

    def peak_memory(self, size: int) -> int:
        return int(self.base + self.per_sample * size)

    def measure(self, size: int, effective: int | None = None) -> SweepTrial:
        self.calls.append(size)
        accumulate = effective // size if effective else 1
        if self.peak_memory(size) > self.memory:
            return SweepTrial(size, accumulate, None, "samples/s", None, False, "out of memory: simulated")
        rates = [self.throughput(size) * (1 + self.rng.uniform(-self.noise, self.noise)) for _ in range(3)]
        return timed(size, rates, self.peak_memory(size), accumulate)

    def fits(self, size: int, margin: float) -> bool:
        return self.peak_memory(size) <= (1 - margin) * self.memory


@pytest.mark.parametrize("seed", range(300))
def test_the_choice_is_within_5_percent_of_the_exhaustive_best_in_at_most_8_trials(seed):
    rng = random.Random(seed)
    curve = Curve(rng)
    start = rng.choice([1, 2, 4, 8, 12, 16, 32, 64])
    while not curve.fits(start, 0.10) and start > 1:
        start //= 2
    keep = rng.random() < 0.3
    effective = start * rng.choice([1, 2, 4, 8, 16]) if keep else None
    result = sweep(lambda s: curve.measure(s, effective), start, effective=effective, memory_bytes=curve.memory)
    grid = candidates(start, effective=effective)
    exhaustive = max(curve.throughput(s) for s in grid if curve.fits(s, 0.10))
    chosen = result.trial(result.chosen)
    again = curve.calls[len(result.trials) :]  # beyond the search: the user's size once more, to compare
    assert len(result.trials) <= 8 and len(set(curve.calls[: len(result.trials)])) == len(result.trials)
    assert again in ([], [start]) and (again == []) == (result.trial(start).measured == 1)
    assert chosen.fits and curve.fits(result.chosen, 0.10)
    assert curve.throughput(result.chosen) >= 0.95 * exhaustive, (result.table(), exhaustive)
    if effective:
        assert effective % result.chosen == 0 and chosen.accumulate * result.chosen == effective


def test_a_size_that_leaves_less_than_the_margin_free_is_not_chosen():
    def measure(size):  # faster with size; 8 GB per sample on an 80 GB device
        return timed(size, [100.0 * size] * 3, size * 8 * GB)

    result = sweep(measure, 2, memory_bytes=80 * GB)
    assert result.chosen == 8  # 72 GB at 9 would leave 10% free; 12 leaves nothing; 8 leaves 20%
    over = [t for t in result.trials if t.size > 9]
    assert over and all(not t.fits and "margin" in t.reason for t in over)
    assert result.series()["size"] == sorted(t.size for t in result.trials)
    assert any("(chosen)" in line for line in result.table())


def test_a_user_size_that_does_not_fit_is_searched_below():
    def measure(size):
        if size > 6:
            return SweepTrial(size, 1, None, "samples/s", None, False, "out of memory: simulated")
        return timed(size, [10.0 * size] * 3)

    result = sweep(measure, 32)
    assert result.chosen == 6 and result.trial(32).fits is False and result.comparison is None  # nothing of yours to compare


def test_a_size_shown_faster_is_chosen_with_the_comparison_s_gain_and_the_user_s_size_measured_again():
    calls: list[int] = []

    def measure(size):  # 4 is 30% faster than the user's 2, at 1% window noise
        calls.append(size)
        base = {1: 600.0, 2: 1000.0, 4: 1300.0}[size]
        return timed(size, [base * 0.99, base, base * 1.01], accumulate=4 // size)

    events: list[str] = []
    result = sweep(measure, 2, effective=4, on_event=events.append)
    assert result.chosen == 4 and calls.count(2) == 2 and calls[-1] == 2  # yours again, after the others
    c = result.comparison
    assert c.size == 4 and c.verdict == "faster" and c.low > 1.02 and c.windows == (6, 3)
    assert result.gain == c.speedup and result.gain == pytest.approx(1.3, rel=0.01)
    assert result.trial(2).measured == 2 and len(result.trial(2).window_rates) == 6
    assert any("micro-batch 4: 1.30" in line and "faster by more than" in line for line in events)
    assert any("(2 fits)" in line for line in result.table())


def test_an_undecided_comparison_keeps_the_user_s_size_and_says_so():
    def measure(size):  # 4 measures 10% faster, at 25% window noise: the windows cannot tell
        base = {1: 600.0, 2: 1000.0, 4: 1100.0}[size]
        return timed(size, [base * 0.75, base, base * 1.25], accumulate=4 // size)

    events: list[str] = []
    result = sweep(measure, 2, effective=4, on_event=events.append)
    assert result.chosen == 2 and result.gain == 1.0  # yours, not "1.10x yours"
    assert result.comparison.size == 4 and result.comparison.verdict == "undecided"
    assert result.comparison.low < 1 < result.comparison.high
    assert any("undecided" in line and "yours stays" in line for line in events)
    assert result.to_dict()["comparison"]["verdict"] == "undecided"


def test_a_trial_without_window_figures_cannot_show_a_gain():
    calls: list[int] = []

    def measure(size):  # one figure per size: 4 looks 30% faster, but nothing is known of the noise
        calls.append(size)
        return SweepTrial(size, 4 // size, {1: 600.0, 2: 1000.0, 4: 1300.0}[size], "samples/s", None, True)

    result = sweep(measure, 2, effective=4)
    assert result.chosen == 2 and result.comparison.verdict == "undecided" and calls.count(2) == 1
    doc = __import__("json").loads(__import__("json").dumps(result.to_dict(), allow_nan=False))  # strict JSON
    assert doc["comparison"]["high"] is None and doc["gain"] == 1.0
    two = [1000.0, 1000.0]
    assert compare_sizes(timed(2, two), timed(4, [1010.0, 1010.0])).verdict == "not_faster"  # exact: 1% < 2%
    assert compare_sizes(timed(2, two), timed(4, [1100.0, 1100.0])).verdict == "faster"


def test_bad_arguments_are_one_line_config_errors():
    ok = lambda s: SweepTrial(s, 1, 1.0, "samples/s", None, True)  # noqa: E731
    with pytest.raises(ConfigError, match="batch size"):
        sweep(ok, 0)
    with pytest.raises(ConfigError, match="not a multiple"):
        sweep(ok, 3, effective=8)
    with pytest.raises(ConfigError, match="margin"):
        sweep(ok, 4, margin=1.5)


# -- speedkit sweep on a recipe ----------------------------------------------------------------------
def _tiny_recipe(batch_size: int, accumulate: int) -> dict:
    return {
        "model": {"class_path": "test_sweep.TinyGPTWithBudget", "init_args": {"budget": 4}},
        "data": {"synthetic": "tokens", "batch_size": batch_size, "seq_len": 32, "vocab_size": 512},
        "trainer": {
            "accelerator": "cpu",
            "max_steps": 10,
            "accumulate_grad_batches": accumulate,
            "logger": False,
            "enable_checkpointing": False,
        },
        "ladder": [],
        "measure": {"warmup": 1, "steps": 2},
        "seed": 0,
    }


def _budgeted_gpt():
    """The tiny GPT with a device's memory stood in for: out-of-memory on a micro-batch over ``budget``."""
    from speedkit.demos import NaiveGPT

    class TinyGPTWithBudget(NaiveGPT):
        def __init__(self, budget: int) -> None:
            super().__init__("tiny", block_size=32)
            self.budget = budget

        def training_step(self, batch, batch_idx):
            tokens = batch[0] if isinstance(batch, (list, tuple)) else batch
            if tokens.shape[0] > self.budget:
                raise torch.OutOfMemoryError(f"simulated: {tokens.shape[0]} sequences over a budget of {self.budget}")
            return super().training_step(batch, batch_idx)

    return TinyGPTWithBudget


TinyGPTWithBudget = _budgeted_gpt()


def test_speedkit_sweep_keeps_the_effective_batch_and_never_chooses_a_size_that_ran_out_of_memory(tmp_path):
    import json

    from speedkit.frontend.recipe import load_recipe
    from speedkit.frontend.sweep_runner import sweep_recipe

    lines: list[str] = []
    result = sweep_recipe(load_recipe(_tiny_recipe(2, 4)), tmp_path, on_event=lines.append)
    assert result.start == 2 and result.effective == 8
    sizes = {t.size: t for t in result.trials}
    assert sizes[8].fits is False and "out of memory" in sizes[8].reason  # 8 > the budget of 4
    assert result.chosen in (1, 2, 4) and sizes[result.chosen].accumulate * result.chosen == 8
    assert all(t.throughput for t in result.trials if t.fits)
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert doc["batch_size_key"] == "data.batch_size" and doc["series"]["size"] == sorted(sizes)
    assert "| micro-batch |" in (tmp_path / "sweep.md").read_text()
    assert any("does not fit" in line for line in lines)


def test_speedkit_sweep_cli_names_a_recipe_without_a_batch_size(tmp_path, capsys):
    from speedkit.frontend.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: {class_path: speedkit.demos.NaiveGPT, init_args: {size: tiny}}\n"
        "data: {synthetic: tokens}\ntrainer: {accelerator: cpu, max_steps: 2}\n"
    )
    assert main(["sweep", str(recipe), "--out", str(tmp_path / "o")]) == 2
    assert "batch_size" in capsys.readouterr().err


def test_speedkit_sweep_cli_lets_the_effective_batch_grow_when_asked(tmp_path, capsys):
    import yaml

    from speedkit.frontend.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_tiny_recipe(2, 1)))
    assert main(["sweep", str(recipe), "--out", str(tmp_path / "o"), "--change-effective-batch", "--max-trials", "3"]) == 0
    out = capsys.readouterr().out
    assert "chosen micro-batch:" in out and "| 8 | 1 | - | - | no: out of memory" in out  # 2 -> 8 (x4) ran out
    doc = __import__("json").loads((tmp_path / "o" / "sweep.json").read_text())
    assert doc["effective"] is None and len(doc["trials"]) <= 3 and all(t["accumulate"] == 1 for t in doc["trials"])
    if doc["chosen"] != 2:  # a larger effective batch: the learning-rate rule that goes with it is stated
        scaling = doc["lr_scaling"]
        assert scaling["effective_batch_ratio"] == doc["chosen"] / 2 and scaling["optimizer"] != "unknown"
        assert "learning rate: effective batch x" in out
    else:
        assert doc["lr_scaling"] is None


def test_the_learning_rate_rule_is_linear_for_sgd_and_square_root_for_adam():
    from speedkit.engine.sweep import lr_scaling

    assert lr_scaling("SGD", 4.0)["factor"] == 4.0
    assert lr_scaling("AdamW", 4.0)["factor"] == 2.0 and "Adam family" in lr_scaling("AdamW", 4.0)["rule"]
    assert lr_scaling("", 4.0)["factor"] == 2.0 and "not known" in lr_scaling("", 4.0)["rule"]
    result = SweepResult(start=8, effective=None, chosen=32)
    assert result.lr_scaling(accumulate=1)["effective_batch_ratio"] == 4.0
    assert SweepResult(start=8, effective=32, chosen=32).lr_scaling(accumulate=4) is None  # effective batch kept


def test_speedkit_sweep_refuses_several_devices_in_one_line(tmp_path, capsys):
    import yaml

    from speedkit.frontend.cli import main

    raw = _tiny_recipe(2, 1)
    raw["trainer"]["devices"] = 2
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["sweep", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "sweep on one device" in err and err.count("\n") == 1  # one line


def test_a_size_is_measured_on_the_worst_case_input_where_batch_shapes_vary():
    import lightning.pytorch as pl
    from torch import nn

    from speedkit.frontend.sweep_runner import timed_fit_trial

    class PaddedLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 50)
            self.lengths: list[int] = []

        def training_step(self, batch, batch_idx):
            self.lengths.append(batch.shape[1])
            return torch.nn.functional.cross_entropy(self.head(self.emb(batch)).flatten(0, 1), batch.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    batches = torch.utils.data.DataLoader(
        [torch.randint(0, 50, (4, n), generator=g) for n in (5, 17, 9, 30, 12, 8, 21, 6)], batch_size=None
    )  # padded per batch
    module = PaddedLM()
    trial = timed_fit_trial(
        4,
        1,
        lambda: (module, {"train_dataloaders": batches}),
        {"accelerator": "cpu", "devices": 1},
        warmup=1,
        window=2,
        windows=2,
    )
    assert trial.fits and set(module.lengths) == {30}  # every step on the longest batch
    assert "worst-case input" in trial.input and "8 shapes seen" in trial.input
    fixed = torch.utils.data.DataLoader([torch.randint(0, 50, (4, 7), generator=g) for _ in range(8)], batch_size=None)
    same = timed_fit_trial(
        4,
        1,
        lambda: (PaddedLM(), {"train_dataloaders": fixed}),
        {"accelerator": "cpu", "devices": 1},
        warmup=1,
        window=2,
        windows=2,
    )
    assert "one shape" in same.input


# -- each size timed after its compile and warm-up (a fake compile cost on a virtual time line) -----
class FakeCompiler:
    """``torch.compile`` stood in for on a virtual time line: the first call of each new input shape
    compiles (``compile_s`` of virtual time, one more graph on the counter ``compat.graph_count``
    reads); the first shape the process meets compiles again at its calls in ``recompile_at`` (the
    recompiles a first size brings: a guard that fails, dynamic shapes marked, autotuning), so its
    compiles reach past a fixed warm-up of two steps."""

    def __init__(self, time, compile_s: float = 30.0, recompile_at: tuple[int, ...] = (5, 9)) -> None:
        self.time, self.compile_s, self.recompile_at = time, compile_s, recompile_at
        self.graphs = 0
        self.calls: dict[tuple[int, ...], int] = {}
        self.first: tuple[int, ...] | None = None

    def __call__(self, shape: tuple[int, ...]) -> None:
        calls = self.calls[shape] = self.calls.get(shape, 0) + 1
        self.first = self.first or shape
        if calls == 1 or (shape == self.first and calls in self.recompile_at):
            self.graphs += 1
            self.time.spend(self.compile_s)


#: seconds of virtual time per micro-batch of each size: with 8 samples per optimizer step, steps of
#: 32, 20, 16 and 20 ms at micro-batches 1, 2, 4 and 8 (250, 400, 500, 400 samples/s): 4 is the fastest
MICRO_BATCH_S = {1: 0.004, 2: 0.005, 4: 0.008, 8: 0.020}
EFFECTIVE = 8


def _costed_module(compiler: FakeCompiler):
    import lightning.pytorch as pl
    from torch import nn

    class CostedModule(pl.LightningModule):
        """A tiny model whose micro-batch costs ``MICRO_BATCH_S`` of virtual time, behind the fake compiler."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)
            self.steps = 0

        def training_step(self, batch, batch_idx):
            compiler(tuple(batch.shape))
            compiler.time.spend(MICRO_BATCH_S[batch.shape[0]])
            self.steps += 1
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return CostedModule()


def _batches(size: int):
    return torch.utils.data.DataLoader([torch.ones(size, 4)] * 256, batch_size=None)


def _fake_compiled_trial(monkeypatch, compiler: FakeCompiler):
    """``measure(size)``: speedkit sweep's timed fit of the costed module at that micro-batch (the
    effective batch of 8 kept), on the virtual time line, the fake compiler's graphs counted."""
    from speedkit import compat
    from speedkit.frontend.sweep_runner import timed_fit_trial

    monkeypatch.setattr(compat, "graph_count", lambda: compiler.graphs)
    modules: dict[int, object] = {}

    def measure(size: int) -> SweepTrial:
        module = modules[size] = _costed_module(compiler)
        return timed_fit_trial(
            size,
            EFFECTIVE // size,
            lambda: (module, {"train_dataloaders": _batches(size)}),
            {"accelerator": "cpu", "devices": 1},
            warmup=2,
            window=2,
            windows=3,
            clock=compiler.time.clock(),
            host_clock=compiler.time,
        )

    return measure, modules


def test_a_fixed_warm_up_times_the_first_size_s_recompiles(monkeypatch):
    """What the sweep did before: two warm-up steps, then windows, whatever compiled in them."""
    import lightning.pytorch as pl
    from fakes import VirtualTime

    from speedkit import compat
    from speedkit.lightning import StepTimer
    from speedkit.measure.session import MeasureSession

    time = VirtualTime()
    compiler = FakeCompiler(time)
    monkeypatch.setattr(compat, "graph_count", lambda: compiler.graphs)

    class FixedWarmupTimer(StepTimer):
        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            self.session = MeasureSession("cpu", clock=time.clock(), host_clock=time)
            self.session.begin_steps(self.window, warmup=self.warmup)

    timer = FixedWarmupTimer(warmup=2, window=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=8, accumulate_grad_batches=2, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_costed_module(compiler), train_dataloaders=_batches(4))
    assert [w.compiled_graphs for w in timer.windows] == [1, 1, 0]  # the recompiles at steps 3 and 5 (calls 5 and 9)
    assert timer.measurement.step_ms > 1000 * 30 / 2 / 2  # the median window holds half a compile per step


def test_the_first_size_is_timed_after_its_compile_and_the_warm_up_after_each_recompile(monkeypatch):
    from fakes import VirtualTime

    compiler = FakeCompiler(VirtualTime())
    measure, modules = _fake_compiled_trial(monkeypatch, compiler)
    first = measure(4)  # micro-batches of 4, accumulated 2: compiles at its calls 1, 5 and 9 (steps 1, 3 and 5)
    step_s = 2 * MICRO_BATCH_S[4]
    assert first.fits and first.compiled_steps == 3 and first.untimed_steps == 5 + 2  # the last compile, then the warm-up
    assert first.window_rates == pytest.approx([EFFECTIVE / step_s] * 3)  # every window the step's own 500 samples/s
    assert first.throughput == pytest.approx(500.0) and first.spread == pytest.approx(0.0, abs=1e-9)
    assert modules[4].steps == 2 * (7 + 3 * 2)  # micro-batches: the fit stopped at its third window
    second = measure(2)  # a new shape: one compile, at its first step
    assert second.compiled_steps == 1 and second.untimed_steps == 1 + 2
    assert second.window_rates == pytest.approx([EFFECTIVE / (4 * MICRO_BATCH_S[2])] * 3)


@pytest.mark.parametrize("start", [4, 2])
def test_the_sweep_chooses_the_truly_fastest_size_though_its_first_size_recompiles(monkeypatch, start):
    from fakes import VirtualTime

    compiler = FakeCompiler(VirtualTime())
    measure, _ = _fake_compiled_trial(monkeypatch, compiler)
    result = sweep(measure, start, effective=EFFECTIVE)
    true_rate = {s: EFFECTIVE / (EFFECTIVE // s * cost) for s, cost in MICRO_BATCH_S.items()}
    for t in result.trials:  # each size at its own rate: no compile in any timed window
        assert t.window_rates == pytest.approx([true_rate[t.size]] * len(t.window_rates)), t
    assert result.trial(start).compiled_steps == 3  # the first size measured brought the recompiles
    assert result.chosen == 4
    if start == 4:
        assert result.gain == 1.0 and result.comparison is None  # yours was the fastest: nothing to compare
    else:
        assert result.comparison.verdict == "faster" and result.gain == pytest.approx(500 / 400)
        assert result.trial(2).measured == 2  # measured again after the others


# -- activation checkpointing: the micro-batch the memory it frees buys ------------------------------------


def test_a_size_that_fits_only_checkpointed_is_measured_so_and_can_be_chosen():
    """8 GB a sample without checkpointing, 3 GB with it, on 80 GB (10% kept free); checkpointed a
    sample costs a fifth more time. Sizes up to 8 fit as they are and are measured so; the first that
    does not is measured again checkpointed, and the larger ones checkpointed at once; the sweep
    chooses the fastest of both kinds (here a checkpointed 24: 1,920 samples/s against 800 at 8)."""
    calls: list[tuple[int, bool]] = []

    def measure(size: int, checkpointed: bool) -> SweepTrial:
        calls.append((size, checkpointed))
        per_sample = 3 if checkpointed else 8
        if size * per_sample * GB > 80 * GB:
            return SweepTrial(size, 1, None, "samples/s", None, False, "out of memory: simulated", short_of_memory=True)
        rate = 100.0 * size / (1.25 if checkpointed else 1.0)
        return timed(size, [rate * f for f in (0.99, 1.0, 1.01)], size * per_sample * GB)

    lines: list[str] = []
    result = sweep(
        checkpointing_where_needed(measure, memory_bytes=80 * GB, margin=0.1, on_event=lines.append), 2, memory_bytes=80 * GB
    )
    by_size = {t.size: t for t in result.trials}
    assert not any(t.checkpointed for t in result.trials if t.size <= 8)
    assert all(t.checkpointed for t in result.trials if t.size > 9), result.table()
    # a size is measured checkpointed after it failed as it is, or once a smaller one fitted only so
    fitted_checkpointed: list[int] = []
    for i, (size, checked) in enumerate(calls):
        if checked:
            assert calls[i - 1] == (size, False) or any(f <= size for f in fitted_checkpointed), calls
            if size * 3 <= 72:
                fitted_checkpointed.append(size)
    assert result.chosen > 9 and by_size[result.chosen].checkpointed and by_size[result.chosen].fits
    assert result.chosen * 3 * GB <= 72 * GB  # within the margin, checkpointed
    assert any("with the blocks checkpointed" in line for line in lines)
    assert any("blocks checkpointed" in line and "(chosen)" in line for line in result.table())
    assert result.series()["checkpointed"] == [by_size[s].checkpointed for s in result.series()["size"]]


def test_checkpointing_is_not_tried_where_a_size_fails_for_another_reason():
    def measure(size: int, checkpointed: bool) -> SweepTrial:
        assert not checkpointed
        if size > 4:
            return SweepTrial(size, 1, None, "samples/s", None, False, "not timed: a graph compiled in every step")
        return timed(size, [10.0 * size] * 3)

    result = sweep(checkpointing_where_needed(measure), 2)
    assert not any(t.checkpointed for t in result.trials)


class TinyGPTCheckpointedBudget(TinyGPTWithBudget):
    """Out of memory over ``budget`` sequences, over four times that with its blocks checkpointed."""

    def training_step(self, batch, batch_idx):
        from speedkit.rungs.activation_checkpointing import CheckpointedForward

        checkpointed = all(isinstance(block.__dict__.get("forward"), CheckpointedForward) for block in self.h)
        budget = self.budget * (4 if checkpointed else 1)
        tokens = batch[0] if isinstance(batch, (list, tuple)) else batch
        if tokens.shape[0] > budget:
            raise torch.OutOfMemoryError(f"simulated: {tokens.shape[0]} sequences over a budget of {budget}")
        return pl_training_step(self, batch, batch_idx)


def pl_training_step(module, batch, batch_idx):
    from speedkit.demos import NaiveGPT

    return NaiveGPT.training_step(module, batch, batch_idx)


@pytest.mark.parametrize("checkpointing", ["auto", "off"])
def test_speedkit_sweep_measures_the_sizes_only_checkpointing_fits(tmp_path, checkpointing):
    """A recipe at micro-batch 2 (the effective batch free to grow) whose model runs out of memory over
    4 sequences, over 16 with its blocks checkpointed: with checkpointing "auto" the sweep measures 8
    and 16 with the activation_checkpointing rung applied in their fits (the run accumulates nothing:
    the rung's without_accumulation), 32 does not fit either way; "off" never checkpoints."""
    import json

    from speedkit.frontend.recipe import load_recipe
    from speedkit.frontend.sweep_runner import sweep_recipe

    raw = _tiny_recipe(2, 1)
    raw["model"]["class_path"] = "test_sweep.TinyGPTCheckpointedBudget"
    result = sweep_recipe(load_recipe(raw), tmp_path, keep_effective=False, checkpointing=checkpointing)
    by_size = {t.size: t for t in result.trials}
    assert by_size[2].fits and not by_size[2].checkpointed
    if checkpointing == "off":
        assert not any(t.checkpointed for t in result.trials) and not by_size[8].fits
        return
    assert by_size[8].fits and by_size[8].checkpointed, result.table()
    assert all(t.checkpointed and (t.fits == (t.size <= 16)) for t in result.trials if t.size > 4), result.table()
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert [t["checkpointed"] for t in doc["trials"]] == [t.checkpointed for t in result.trials]
    if by_size[result.chosen].checkpointed:
        assert "activation_checkpointing" in (tmp_path / "sweep.md").read_text()
