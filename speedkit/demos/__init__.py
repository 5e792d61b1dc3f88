"""Reference models used by recipes, tests and benchmarks (written naively on purpose)."""

from speedkit.demos.batched import LoopGEMMModel, LoopOfGEMMs, SyntheticGEMMs
from speedkit.demos.data import DecodedImages, SyntheticImages, SyntheticTokens, SyntheticVectors
from speedkit.demos.gpt2 import NaiveGPT
from speedkit.demos.mlp import LaunchBoundMLP
from speedkit.demos.vision import SmallResNet

__all__ = [
    "DecodedImages",
    "LaunchBoundMLP",
    "LoopGEMMModel",
    "LoopOfGEMMs",
    "NaiveGPT",
    "SmallResNet",
    "SyntheticGEMMs",
    "SyntheticImages",
    "SyntheticTokens",
    "SyntheticVectors",
]
