"""Reference models used by recipes, tests and benchmarks (written naively on purpose)."""

from speedkit.demos.batched import LoopGEMMModel, LoopOfGEMMs, SyntheticGEMMs
from speedkit.demos.data import SyntheticImages, SyntheticTokens, SyntheticVectors
from speedkit.demos.gpt2 import NaiveGPT
from speedkit.demos.mlp import LaunchBoundMLP

__all__ = ["LaunchBoundMLP", "LoopGEMMModel", "LoopOfGEMMs", "NaiveGPT", "SyntheticGEMMs", "SyntheticImages", "SyntheticTokens", "SyntheticVectors"]
