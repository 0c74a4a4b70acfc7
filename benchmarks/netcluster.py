"""Real limited links: `allreduce`, `ako` (p = auto) and `bsp` (1 server) on 4 worker hosts of
`scripts/netcluster` (network namespaces, every link 100 Mbit/s each way by tc tbf, torchrun
with the c10d rendezvous, one process per host), side by side: the cnn on Fashion-MNIST (time
to 85% test accuracy) or, with `--model gpt`, the gpt on Debian's fortunes with AdamW (time to
a validation loss, `--target`); bytes per worker per second. Needs root.

All hosts share this machine's cores: with 2 cores and 4 or 5 processes, compute is shared
too, so the table compares the strategies on these links, not on 4 dedicated machines.

    .venv/bin/python benchmarks/netcluster.py   # as root [--rate 100mbit] [--epochs 2] [--workers 4]
    .venv/bin/python benchmarks/netcluster.py --model gpt --strategies allreduce,ako --seeds 0,1,2 --target 2.3,2.25

With several seeds each cell is the median over them, and "vs allreduce" the median of each
seed's ratio to allreduce's time with that seed. Times are training seconds (rank 0's clock);
evaluations are of snapshots, evaluated after training. Each run goes to
`<out-dir>/<model>/<strategy>-seed<seed>/`; `--reuse` takes a run already there instead of
training again (a table for another target from the same runs). One table per target.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from run_records import latest_run, targets, time_to

SCRIPT = Path(__file__).parents[1] / "scripts" / "netcluster"
RUNS = {"allreduce": [], "ako": ["--partitions", "auto"], "bsp": ["--servers", "1"]}
WORKLOADS = {  # model -> ako train's arguments, the metric of its target, and the target's default
    "cnn": (["--dataset", "fashion-mnist", "--eval-every", "0.1"], "test_accuracy", 0.85),
    "gpt": (["--dataset", "fortunes", "--model", "gpt", "--batch-size", "16", "--optimizer", "adamw", "--lr", "3e-3",
             "--warmup", "20", "--lr-schedule", "cosine", "--eval-every", "0.0625"], "test_loss", 2.3),
}  # fmt: skip


def run(strategy: str, seed: int, args) -> tuple[dict, list[dict]]:
    """One run on the test bed (or, with --reuse, the one already in its folder): its summary
    and metrics.jsonl's records."""
    out = Path(args.out_dir) / args.model / f"{strategy}-seed{seed}"
    if args.reuse and (done := latest_run(out)):
        return done
    servers = 1 if strategy == "bsp" else 0
    cmd = [sys.executable, str(SCRIPT), "--hosts", str(args.workers + servers), "--rate", args.rate, "--",
           "--strategy", strategy, *RUNS[strategy], *WORKLOADS[args.model][0], "--epochs", str(args.epochs),
           "--seed", str(seed), "--out-dir", str(out), "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True)
    return latest_run(out)


def table(rows: dict[str, list], metric: str, target: float, args) -> None:
    """The markdown table of every strategy's runs at `target`."""
    print(f"\n| strategy | time to {metric} {'<=' if metric.endswith('loss') else '>='} {target:g} | vs allreduce | "
          f"MB/s sent per worker | samples/s | {metric} at the end | training s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    reference = [time_to(records, metric, target) for _, records in rows.get("allreduce", [])]
    for strategy, runs in rows.items():
        times = [time_to(records, metric, target) for _, records in runs]
        shown = f"{statistics.median(times):.1f} s" if None not in times else f"not reached ({times})"
        ratios = [a / b for a, b in zip(times, reference) if a is not None and b is not None]
        ratio = f"{statistics.median(ratios):.2f}x" if reference and len(ratios) == len(times) else "-"
        median = lambda key: statistics.median(s[key] for s, _ in runs)  # noqa: E731
        print(f"| `{strategy}` | {shown} | {ratio} | {median('bytes_sent_per_worker_per_second') / 1e6:.2f} | "
              f"{median('samples_per_second'):.0f} | {median(metric):.4f} | {median('train_seconds'):.1f} |")  # fmt: skip
        print(f"<!-- {strategy}: each seed's time {times}, ratio {[round(r, 3) for r in ratios]} -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="cnn")
    parser.add_argument("--target", type=targets,
                        help="test accuracy (cnn, default 0.85) or validation loss (gpt, default 2.3), comma-separated: a table each")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; medians over them")
    parser.add_argument("--strategies", default=",".join(RUNS))
    parser.add_argument("--out-dir", default="runs/netcluster")
    parser.add_argument("--reuse", action="store_true", help="take the runs already in --out-dir instead of training")
    args = parser.parse_args()
    _, metric, default = WORKLOADS[args.model]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = {s: [run(s, seed, args) for seed in seeds] for s in args.strategies.split(",")}
    print(f"\n{args.workers} worker hosts, links {args.rate} each way, {args.model}, {args.epochs:g} epochs, seeds {args.seeds}")
    for target in args.target or [default]:
        table(rows, metric, target, args)
    if rows.get("ako"):
        print(f"ako (seed {seeds[0]}): {rows['ako'][0][0].get('partitions_reason', '')}")


if __name__ == "__main__":
    main()
