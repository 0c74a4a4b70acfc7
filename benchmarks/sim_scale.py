"""Speed and memory of the simulator at scale: one `ako simulate` run (default: 64 workers,
allreduce, the cnn on Fashion-MNIST to 85%, 1 Gbit/s links, 100 us latency, worker 3 at factor
4), in this process with one torch thread. Prints the real seconds, the share that is not
forward/backward (and what it is), and peak memory against one flat replica per worker.

    .venv/bin/python benchmarks/sim_scale.py [--strategy ako] [--workers 64] [--batch-size 16]
        [--profile]   # also print the functions that take the most time outside forward/backward
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource

import torch

import ako


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="allreduce")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=float, default=8.0)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--seconds-per-sample", type=float, default=None, help="default: measured")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out-dir", default="runs/sim_scale")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = ako.TrainConfig(
        strategy=args.strategy, workers=args.workers, dataset="fashion-mnist", model="cnn",
        batch_size=args.batch_size, lr=args.lr, epochs=args.epochs, target_accuracy=args.target,
        bandwidth="1Gbit", latency="100us", straggler=("rank=3,factor=4",), progress=False,
        seconds_per_sample=args.seconds_per_sample, out_dir=args.out_dir,
    )  # fmt: skip
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    summary = ako.simulate(config).summary
    if profiler:
        profiler.disable()
    s = summary["simulation"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    numel = summary.get("numel") or 225_034
    other = s["real_seconds"] - s["forward_backward_seconds"]
    print(
        f"\n{args.workers} workers, {args.strategy}: {s['real_seconds']:.0f} s real for {s['virtual_seconds']:.1f} virtual s; "
        f"reached {args.target:.0%}: {summary['time_to_accuracy'].get(f'{args.target:g}')} virtual s\n"
        f"forward/backward {s['forward_backward_seconds']:.0f} s; the rest {other:.0f} s "
        f"= {s['not_forward_backward_share']:.0%} of run time, of which evaluation {s['evaluation_seconds']:.0f} s\n"
        f"peak memory {peak:.0f} MiB; one flat replica is {numel * 4 / 2**20:.2f} MiB "
        f"(x {args.workers} workers = {args.workers * numel * 4 / 2**20:.0f} MiB)"
    )
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
