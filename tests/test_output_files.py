"""speedkit's output files are written whole or not at all: a full disk loses no result."""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from speedkit.errors import OutputError
from speedkit.files import write_text_atomic
from speedkit.frontend.cli import OUTPUT_ERROR_EXIT, main

FAST_RECIPE = (
    "model: {class_path: speedkit.demos.NaiveGPT, init_args: {size: tiny}}\n"
    "data: {synthetic: tokens, batch_size: 2, seq_len: 16, length: 64}\ntrainer: {accelerator: cpu}\n"
    "ladder: [fused_optimizer]\n"
    "measure: {warmup: 1, steps: 2, repeats: 2, parity_steps: 2, min_blocks: 2, max_blocks: 2, holds_windows: 1}\n"
)


def _full_disk_at(monkeypatch, name: str) -> None:
    """The disk fills up while ``name`` is written (after some of its bytes went out)."""
    real_fdopen = os.fdopen

    class Filling:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    def fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        return Filling(f) if os.path.basename(target).startswith(f".{name}.") else f

    monkeypatch.setattr("speedkit.files.os.fdopen", fdopen)


def test_a_failed_write_leaves_the_earlier_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text("earlier, complete")
    _full_disk_at(monkeypatch, "report.json")
    with pytest.raises(OutputError, match=r"cannot write .*report.json: No space left on device") as raised:
        write_text_atomic(path, "x" * 10_000)
    assert "\n" not in str(raised.value)
    assert path.read_text() == "earlier, complete" and os.listdir(tmp_path) == ["report.json"]
    monkeypatch.undo()
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["report.json"]
    assert (path.stat().st_mode & 0o777) == 0o666 & ~_umask()  # as readable as any file the user writes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _files(out: Path) -> list[str]:
    """The output folder's files (the profile's traces/ folder, written during the trials, left out)."""
    return sorted(name for name in os.listdir(out) if name != "traces")


@pytest.mark.parametrize("fills_at", ["report.json", "report.md", "report.html", "optimized.yaml"])
def test_optimize_on_a_full_disk_prints_the_results_one_line_and_leaves_nothing_half_written(
    tmp_path, capsys, monkeypatch, fills_at
):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(FAST_RECIPE)
    out = tmp_path / "out"
    _full_disk_at(monkeypatch, fills_at)
    assert main(["optimize", str(recipe), "--out", str(out)]) == OUTPUT_ERROR_EXIT
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err, err
    assert f"cannot write {out / fills_at}: No space left on device" in err[0] and "printed above" in err[0]
    assert "baseline" in captured.out and "fused_optimizer" in captured.out  # the ladder's table: nothing lost
    before = {
        "report.json": [],
        "report.md": ["report.json"],
        "report.html": ["report.json", "report.md"],
        "optimized.yaml": ["report.html", "report.json", "report.md"],
    }[fills_at]
    assert _files(out) == before  # the files before it whole, nothing of it, no temporary file
    for name in before:
        assert (out / name).stat().st_size > 0
    if "report.json" in before:
        assert json.loads((out / "report.json").read_text())["schema_version"] == 4
    monkeypatch.undo()
    assert main(["optimize", str(recipe), "--out", str(out)]) == 0  # the next run into that folder is not refused
    assert _files(out) == ["optimized.yaml", "report.html", "report.json", "report.md"]


def test_an_empty_report_left_by_an_earlier_version_does_not_block_the_next_run(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("")  # a write cut off by a full disk, before writes were atomic
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(FAST_RECIPE)
    assert main(["optimize", str(recipe), "--out", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["schema_version"] == 4


@contextlib.contextmanager
def _tmpfs(size: str):
    where = Path(f"/tmp/speedkit-full-{uuid.uuid4().hex[:8]}")
    where.mkdir()
    try:
        mounted = (
            os.geteuid() == 0
            and subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
            ).returncode
            == 0
        )
        if not mounted:
            pytest.skip("cannot mount a small tmpfs here (needs root); the injected-error tests cover the logic")
        try:
            yield where
        finally:
            subprocess.run(["umount", str(where)], check=False)
    finally:
        with contextlib.suppress(OSError):
            where.rmdir()


def test_optimize_into_a_really_full_filesystem(tmp_path, capsys):
    """A tmpfs filled up but for one page: no report (several pages) fits."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(FAST_RECIPE)
    with _tmpfs("64k") as small:
        filler = small / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as f:
            f.write(b"x" * (60 * 1024))
        out = small / "run"
        assert main(["optimize", str(recipe), "--out", str(out)]) == OUTPUT_ERROR_EXIT
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and "No space left on device" in err[0], err
        assert "baseline" in captured.out
        assert all(not name.startswith(".") for name in os.listdir(out))  # no temporary file left behind
        assert not (out / "report.json").exists() or json.loads((out / "report.json").read_text())
        for name in _files(out):  # what is there is whole
            text = (out / name).read_text()
            if name == "report.json":
                json.loads(text)
        for trace in (out / "traces").iterdir() if (out / "traces").is_dir() else ():  # a trace is whole or absent
            assert not trace.name.startswith(".")
            json.loads(gzip.decompress(trace.read_bytes()))
