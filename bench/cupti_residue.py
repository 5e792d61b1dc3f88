"""What a torch.profiler window leaves behind: a launch-bound step's time before and after one.

kineto leaves NVIDIA's CUPTI attached after a profile with CUDA activities unless ``TEARDOWN_CUPTI=1``
(pytorch/pytorch#144455), and then every kernel launch pays its callbacks. speedkit profiles the
step to diagnose it before the rungs are timed, so a profile that leaves CUPTI attached slows every
configuration timed after it that launches kernels one by one (not a CUDA graph's replay): the
trials' figures for the graph-free arms, and the fit.

Each mode runs in a fresh process (CUPTI's state is the process's): a step of 48 Linear + LayerNorm
+ GELU layers and AdamW (a few hundred launches, host-bound on any GPU), eager and compiled, timed
in windows before and after speedkit's own ``profile_window``:

  control            no profile between the two measurements (the drift)
  profile_attached   the window with ``TEARDOWN_CUPTI=0``, as kineto behaves when it is not set
  profile_detached   speedkit's window as it runs (CUPTI detached at its stop)
  graph_twice        a CUDA graph captured first, then two detached windows (CUPTI re-attached
                     after a teardown beside a graph: torch's own code says it crashed before CUDA 12.6)
  profile_seven      seven detached windows back to back, as a fit's diagnosis and its profile phase
                     (the baseline, each kept rung, the final configuration) run them
  profile_seven_kept the same with ``TEARDOWN_CUPTI=1`` kept set throughout (kineto's teardown thread reads
                     it again after the teardown, to decide whether to re-enable CUPTI's callbacks)

Rows: ``bench: "cupti_residue"``, variant ``<mode>/<eager|compiled>``, metric ``after_over_before``
(the ratio of median step times), ``step_ms_before`` / ``step_ms_after``, and ``launch_us_before`` /
``launch_us_after``: host microseconds per launch of a one-element kernel, CUPTI's cost per launch
without the step's own drift (a step measured twice in one process drifted by ±10% on an H100 host).

Usage: PYTHONPATH=. python bench/cupti_residue.py [--results out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("control", "profile_attached", "profile_detached", "graph_twice", "profile_seven", "profile_seven_kept")
WINDOWS, STEPS = 9, 20


def _step(compiled: bool):
    torch.manual_seed(0)
    layers = []
    for _ in range(48):
        layers += [nn.Linear(512, 512), nn.LayerNorm(512), nn.GELU()]
    model = nn.Sequential(*layers).cuda()
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 512, device="cuda")

    def run_one() -> None:
        forward(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run_one


def _median_ms(run_one) -> float:
    """The median of WINDOWS windows' mean step time, on speedkit's step clock (CUDA events), warmed up first."""
    from speedkit.measure.session import MeasureSession

    return statistics.median(MeasureSession("cuda").window_times(run_one, warmup=10, steps=STEPS, repeats=WINDOWS))


def _launch_us() -> float:
    """Host microseconds per launch of a one-element kernel (the median of 7 runs of 2000 launches): what
    CUPTI's callbacks add to every launch, without the step's own drift between two measurements."""
    x = torch.zeros(1, device="cuda")
    for _ in range(200):
        x.add_(1)
    torch.cuda.synchronize()
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(2000):
            x.add_(1)
        runs.append((time.perf_counter() - t0) / 2000 * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def _profile(run_one) -> None:
    from speedkit.profile.window import profile_window

    profile_window(run_one, steps=3, warmup=1, label="residue", device="cuda")


def _graph() -> None:
    """A CUDA graph captured and replayed, as the cuda_graph rung leaves one in the process."""
    static = torch.randn(256, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (static @ static).relu()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = (static @ static).relu()
    graph.replay()
    torch.cuda.synchronize()
    _graph.keep = (graph, static, out)  # type: ignore[attr-defined]


def child(mode: str, compiled: bool) -> dict:
    run_one = _step(compiled)
    if mode == "graph_twice":
        _graph()
    before, launch_before = _median_ms(run_one), _launch_us()
    if mode == "profile_attached":
        os.environ["TEARDOWN_CUPTI"] = "0"
    if mode != "control":
        _profile(run_one)
    if mode == "profile_seven_kept":
        os.environ["TEARDOWN_CUPTI"] = "1"
    if mode in ("profile_seven", "profile_seven_kept"):
        for _ in range(6):
            _profile(run_one)
    if mode == "graph_twice":
        _profile(run_one)
        _graph.keep[0].replay()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
    after, launch_after = _median_ms(run_one), _launch_us()
    return {"before": before, "after": after, "launch_us_before": launch_before, "launch_us_after": launch_after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--forms", default="eager,compiled", help="comma-separated, of: eager, compiled")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "FORM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], args.child[1] == "compiled")), flush=True)
        return
    from bench.common import Results

    results = Results("cupti_residue", args.results)
    print(f"{'mode':<18} {'form':<9} {'before ms':>10} {'after ms':>10} {'after/before':>13} {'launch us before/after':>23}")
    for form in args.forms.split(","):
        for mode in args.modes.split(","):
            env = {k: v for k, v in os.environ.items() if k != "TEARDOWN_CUPTI"}
            done = subprocess.run(
                [sys.executable, __file__, "--child", mode, form], capture_output=True, text=True, env=env, timeout=300
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                print(f"{mode:<18} {form:<9} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
                results.add(f"{mode}/{form}", "exit_code", done.returncode, "code")
                continue
            got = json.loads(lines[-1][len("RESULT ") :])
            ratio = got["after"] / got["before"]
            launches = f"{got['launch_us_before']:.2f} / {got['launch_us_after']:.2f}"
            print(f"{mode:<18} {form:<9} {got['before']:>10.3f} {got['after']:>10.3f} {ratio:>12.3f}x {launches:>23}")
            results.add(f"{mode}/{form}", "step_ms_before", got["before"], "ms")
            results.add(f"{mode}/{form}", "step_ms_after", got["after"], "ms")
            results.add(f"{mode}/{form}", "after_over_before", ratio, "x")
            results.add(f"{mode}/{form}", "launch_us_before", got["launch_us_before"], "us")
            results.add(f"{mode}/{form}", "launch_us_after", got["launch_us_after"], "us")


if __name__ == "__main__":
    main()
