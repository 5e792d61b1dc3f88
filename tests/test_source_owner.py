"""Whose code a file is (``speedkit.rewrite.source.is_callers_file``): decided by where torch, Lightning
and speedkit are installed, not by the words in a path. A user's project in a folder named ``speedkit``,
``torch`` or ``lightning`` (a clone of speedkit, say) is the user's code, and the capture check reads
it: the fresh-clone CI in a folder named ``speedkit`` found three checks that had read nothing."""

from __future__ import annotations

import importlib.util
import inspect
import sys

import lightning.pytorch as pl
import torch

import speedkit
from speedkit.cudagraph.safety import scan_step
from speedkit.rewrite.source import is_callers_file, is_users_own_file

USER_STEP = """
import random

import lightning.pytorch as pl
import torch
from torch import nn


def jitter(loss):
    return loss * random.uniform(0.9, 1.1)


class Jittered(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return jitter(self.net(batch).sum())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
"""


def _import_from(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_users_project_in_folders_named_like_the_frameworks_is_the_users(tmp_path):
    folder = tmp_path / "speedkit" / "torch" / "lightning"
    folder.mkdir(parents=True)
    path = folder / "user_step.py"
    path.write_text(USER_STEP)
    assert is_callers_file(str(path)) and is_users_own_file(str(path))
    module = _import_from(path, "user_step_in_framework_named_folders")
    try:
        blockers = scan_step(module.Jittered())
    finally:
        del sys.modules["user_step_in_framework_named_folders"]
    found = [b for b in blockers if "random" in b.reason]
    assert found and found[0].where.startswith(f"{path}:"), [str(b) for b in blockers]


def test_the_frameworks_own_files_are_not_the_callers():
    for package in (torch, pl, speedkit):
        assert not is_callers_file(inspect.getfile(package)), package
    assert not is_callers_file(inspect.getfile(torch.nn.Linear))
    assert is_callers_file("<string>") and not is_users_own_file("<frozen runpy>")
