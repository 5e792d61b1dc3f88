"""The batch-size sweep's search (speedkit.engine.sweep) on synthetic throughput and memory curves: the
choice is within 5% of the best an exhaustive sweep of the same sizes finds, in at most 8 trials,
and never a size that runs out of memory or leaves less than the margin free."""

from __future__ import annotations

import random

import pytest
import torch

from speedkit.engine.sweep import SweepResult, SweepTrial, candidates, sweep
from speedkit.errors import ConfigError

GB = 10**9


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
        rate = self.throughput(size) * (1 + self.rng.uniform(-self.noise, self.noise))
        return SweepTrial(size, accumulate, rate, "samples/s", self.peak_memory(size), True)

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
    assert len(result.trials) <= 8 and len(set(curve.calls)) == len(curve.calls)  # no size measured twice
    assert chosen.fits and curve.fits(result.chosen, 0.10)
    assert curve.throughput(result.chosen) >= 0.95 * exhaustive, (result.table(), exhaustive)
    if effective:
        assert effective % result.chosen == 0 and chosen.accumulate * result.chosen == effective


def test_a_size_that_leaves_less_than_the_margin_free_is_not_chosen():
    def measure(size):  # faster with size; 8 GB per sample on an 80 GB device
        return SweepTrial(size, 1, 100.0 * size, "samples/s", size * 8 * GB, True)

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
        return SweepTrial(size, 1, 10.0 * size, "samples/s", None, True)

    result = sweep(measure, 32)
    assert result.chosen == 6 and result.trial(32).fits is False


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
