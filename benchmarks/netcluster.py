"""Real limited links: `allreduce`, `ako` (p = auto) and `bsp` (1 server) on 4 worker hosts of
`scripts/netcluster` (network namespaces, every link 100 Mbit/s each way by tc tbf, torchrun
with the c10d rendezvous, one process per host), the cnn on Fashion-MNIST: time to 85% test
accuracy and bytes per worker per second, side by side. Needs root.

All hosts share this machine's cores: with 2 cores and 4 or 5 processes, compute is shared
too, so the table compares the strategies on these links, not on 4 dedicated machines.

    .venv/bin/python benchmarks/netcluster.py   # as root [--rate 100mbit] [--epochs 2] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "netcluster"
RUNS = {"allreduce": [], "ako": ["--partitions", "auto"], "bsp": ["--servers", "1"]}


def run(strategy: str, args) -> dict:
    out = Path(args.out_dir) / strategy
    servers = 1 if strategy == "bsp" else 0
    cmd = [sys.executable, str(SCRIPT), "--hosts", str(args.workers + servers), "--rate", args.rate, "--",
           "--strategy", strategy, *RUNS[strategy], "--dataset", "fashion-mnist", "--epochs", str(args.epochs),
           "--eval-every", "0.1", "--out-dir", str(out), "--no-progress"]  # fmt: skip
    subprocess.run(cmd, check=True)
    latest = max(out.glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(latest.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--strategies", default=",".join(RUNS))
    parser.add_argument("--out-dir", default="runs/netcluster")
    args = parser.parse_args()
    rows = [(s, run(s, args)) for s in args.strategies.split(",")]
    print(f"\n{args.workers} worker hosts, links {args.rate} each way, cnn on Fashion-MNIST, {args.epochs:g} epochs")
    print(f"{'strategy':<10} {'time to 85%':>12} {'MB/s sent per worker':>21} {'samples/s':>10} {'accuracy':>9} {'train s':>8}")
    for strategy, s in rows:
        tta = s["time_to_accuracy"].get("0.85")
        shown = "not reached" if tta is None else f"{tta:.1f} s"
        mbs = s["bytes_sent_per_worker_per_second"] / 1e6
        print(f"{strategy:<10} {shown:>12} {mbs:>21.2f} {s['samples_per_second']:>10.0f} "
              f"{s['test_accuracy']:>9.4f} {s['train_seconds']:>8.1f}")  # fmt: skip
        if strategy == "ako":
            print(f"  ako: {s.get('partitions_reason', '')}")


if __name__ == "__main__":
    main()
