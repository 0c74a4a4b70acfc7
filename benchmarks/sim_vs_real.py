"""Fidelity of the simulator: one configuration on the distributed runtime and on the simulator
calibrated from the same machine; time to 85% test accuracy from both, and their ratio.

Configuration: 4 workers (+ 1 server for the parameter-server strategies), the cnn on
Fashion-MNIST, batch 64, worker 1 slowed by a factor of 3, `--epochs` epochs, rank 0's replica
snapshotted every 0.1 epoch and evaluated after training (as benchmarks/stragglers.py does).

Calibration: `ako calibrate --processes <workers>`, seconds per sample with 1..n processes
computing at once, one thread each, as the distributed runtime's workers run; the simulator
then models the workers sharing this machine's cores (`costs.SharedHost`), which matters here:
4 workers share 2 cores, and the straggler's waits leave its core to the others. Links:
loopback as measured here (docs/design.md, "Facts of torch.distributed": send/recv about 1.9 GB/s, a 170 us
round trip), unless --bandwidth/--latency say otherwise.

    .venv/bin/python benchmarks/sim_vs_real.py [--strategies allreduce,ako,bsp] [--epochs 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import ako

VARIANTS = {
    "allreduce": {},
    "ako": {},
    "bsp": {},
    "ssp": {"staleness": 2},
    "asp": {},
    "absp": {},
    "easgd": {},
    "gossip": {},
}


def config_for(strategy: str, args, **extra) -> ako.TrainConfig:
    return ako.TrainConfig(
        strategy=strategy, workers=args.workers, dataset="fashion-mnist", model="cnn", epochs=args.epochs,
        eval_every=0.1, progress=False, out_dir=args.out_dir, straggler=(f"rank=1,factor={args.factor:g}",),
        **VARIANTS[strategy], **extra,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(VARIANTS))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--bandwidth", default="1.9GB")
    parser.add_argument("--latency", default="85us")
    parser.add_argument("--out-dir", default="runs/sim_vs_real")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    profile = str(Path(args.out_dir) / "profile.toml")
    shared = ako.calibrate(config_for("allreduce", args), profile, processes=args.workers)["shared_seconds_per_sample"]
    print("calibrated: " + " / ".join(f"{t * 1e3:.3f}" for t in shared) + f" ms/sample with 1..{args.workers} processes at once", flush=True)
    rows = []
    for strategy in strategies:
        real = ako.train(config_for(strategy, args)).summary
        torch.set_num_threads(1)  # the simulator's gradients: one thread, as a worker's
        sim = ako.simulate(
            config_for(strategy, args, profile=profile, bandwidth=args.bandwidth, latency=args.latency)
        ).summary
        rows.append((strategy, real["time_to_accuracy"]["0.85"], sim["time_to_accuracy"]["0.85"], real, sim))
        print(f"{strategy}: real {rows[-1][1]} s, simulated {rows[-1][2]} s", flush=True)
    print(f"\ntime to 85% (s), {args.workers} workers, worker 1 at factor {args.factor:g}, {args.epochs:g} epochs")
    print(f"{'strategy':<10} {'real':>8} {'simulated':>10} {'sim/real':>9} {'real total':>11} {'sim total':>10}")
    for strategy, r, s, real, sim in rows:
        ratio = "-" if r is None or s is None else f"{s / r:.2f}"
        show = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(
            f"{strategy:<10} {show(r):>8} {show(s):>10} {ratio:>9} {real['train_seconds']:>11.1f} {sim['train_seconds']:>10.1f}"
        )


if __name__ == "__main__":
    main()
