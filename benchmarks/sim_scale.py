"""Speed and memory of the simulator at scale, optionally side by side with an older revision.

One `ako simulate` run (default: 64 workers,
allreduce, the cnn on Fashion-MNIST, batch 16, 1 Gbit/s links, 100 us latency, worker 3 at
factor 4), with `--threads` torch threads (default 1, as a sweep cell runs). Prints the real
seconds per simulated epoch, the share that is not forward/backward, the peak memory (of
the whole process: run it at two worker counts for the memory per worker), and a hash of the final replicas (equal hashes: the same result, bit
for bit).

With `--baseline REV`, the same run is made with the code of git revision REV too, each in
its own process, alternating, and the ratios are printed side by side:

    .venv/bin/python benchmarks/sim_scale.py [--strategy ako] [--workers 64] [--batch-size 16]
        [--epochs 1] [--threads 2] [--baseline REV] [--repeats 1]
        [--profile]   # also print the functions that take the most time outside forward/backward
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import os
import pstats
import resource
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_here(args) -> dict:
    """One simulation in this process; its figures."""
    import torch

    import ako

    torch.set_num_threads(args.threads)
    config = ako.TrainConfig(
        strategy=args.strategy, workers=args.workers, dataset="fashion-mnist", model="cnn",
        batch_size=args.batch_size, lr=args.lr, epochs=args.epochs, target_accuracy=args.target,
        bandwidth="1Gbit", latency="100us", straggler=("rank=3,factor=4",), progress=False,
        seconds_per_sample=args.seconds_per_sample, out_dir=args.out_dir,
    )  # fmt: skip
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    result = ako.simulate(config)
    if profiler:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    s, summary = result.summary["simulation"], result.summary
    return {
        "real_seconds": s["real_seconds"], "forward_backward_seconds": s["forward_backward_seconds"],
        "evaluation_seconds": s["evaluation_seconds"], "virtual_seconds": s["virtual_seconds"],
        "epochs": summary["epochs"], "test_accuracy": summary.get("test_accuracy"),
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "numel": summary.get("numel") or result.workers[0].params.numel(),
        "hash": hashlib.sha1(b"".join(w.params.numpy().tobytes() for w in result.workers)).hexdigest()[:12],
    }  # fmt: skip


def run_child(args, src: Path) -> dict:
    """One simulation in a fresh process with the package at `src`."""
    argv = [sys.executable, __file__, "--child", *_passed(args)]
    env = dict(os.environ, PYTHONPATH=str(src))
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"sim_scale: the run with {src} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _passed(args) -> list[str]:
    flags = []
    for name in ("strategy", "workers", "batch_size", "lr", "epochs", "target", "threads", "seconds_per_sample", "out_dir"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def baseline_tree(rev: str, into: Path) -> Path:
    """The package source of git revision `rev`, unpacked under `into`; returns its src/."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=False)
    if archive.returncode != 0:
        sys.exit(f"sim_scale: --baseline {rev}: {archive.stderr.decode().strip()}")
    path = into / "baseline.tar"
    path.write_bytes(archive.stdout)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def describe(label: str, r: dict) -> str:
    other = r["real_seconds"] - r["forward_backward_seconds"]
    per_epoch = r["real_seconds"] / r["epochs"]
    return (
        f"{label:<9} {per_epoch:8.1f} s/epoch  ({r['real_seconds']:.1f} s real for {r['epochs']:.2f} epochs, "
        f"{r['virtual_seconds']:.2f} virtual s)  forward/backward {r['forward_backward_seconds']:.1f} s, "
        f"the rest {other:.1f} s = {other / r['real_seconds']:.0%} (evaluation {r['evaluation_seconds']:.1f} s)  "
        f"peak memory {r['peak_mib']:.0f} MiB  accuracy {r['test_accuracy']}  "
        f"replicas {r['hash']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--strategy", default="allreduce", help="any ako strategy")
    parser.add_argument("--workers", type=int, default=64, help="simulated workers")
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
    parser.add_argument("--epochs", type=float, default=1.0, help="epochs simulated")
    parser.add_argument("--target", type=float, default=0.99, help="stop at this accuracy (default: not before --epochs)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a sweep cell)")
    parser.add_argument("--seconds-per-sample", type=float, default=4e-4, help="compute cost (default: experiment 1's)")
    parser.add_argument("--baseline", metavar="REV", help="also run the code of this git revision, side by side")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (the median is compared)")
    parser.add_argument("--profile", action="store_true", help="print the 15 functions that take the most time")
    parser.add_argument("--out-dir", default="runs/sim_scale", help="where the runs go")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_here(args)))
        return
    print(f"{args.workers} workers, {args.strategy}, batch {args.batch_size}, {args.threads} torch thread(s), "
          f"{args.epochs:g} epochs")  # fmt: skip
    if args.baseline is None:
        print(describe("this tree", run_here(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        old_src = baseline_tree(args.baseline, Path(tmp))
        runs: dict[str, list[dict]] = {args.baseline: [], "this tree": []}
        for _ in range(args.repeats):  # alternating, so that a slower spell of the machine hits both
            runs[args.baseline].append(run_child(args, old_src))
            runs["this tree"].append(run_child(args, ROOT / "src"))
    medians = {label: sorted(rs, key=lambda r: r["real_seconds"] / r["epochs"])[len(rs) // 2] for label, rs in runs.items()}
    for label, r in medians.items():
        print(describe(label, r))
    old, new = medians[args.baseline], medians["this tree"]
    speedup = (old["real_seconds"] / old["epochs"]) / (new["real_seconds"] / new["epochs"])
    same = "the same final replicas, bit for bit" if old["hash"] == new["hash"] else "DIFFERENT final replicas"
    print(f"speed-up per simulated epoch: {speedup:.2f}x (median of {args.repeats}); {same}")


if __name__ == "__main__":
    main()
