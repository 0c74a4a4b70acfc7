"""Every strategy on the language model, side by side in one run: the gpt on Debian's fortunes,
4 workers on loopback, AdamW (lr 3e-3, 20 warm-up steps, cosine), batch 16 a worker, 1 epoch
(283 steps): time to a validation loss (rank 0's replica, and the replicas' average where
they differ), its ratio to allreduce's, the loss after the epoch, and tokens/s.

    .venv/bin/python benchmarks/lm_strategies.py [--target 2.5] [--epochs 1] [--seeds 0]
        [--strategies allreduce,ako,gossip,bsp,ssp,asp,absp,easgd]

A strategy may be `ako:deltas` for Ako with --update deltas. Evaluations are of snapshots
every eighth of an epoch, evaluated after training; time is training seconds (rank 0's clock).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import ako

STRATEGIES = "allreduce,ako,gossip,bsp,ssp,asp,absp,easgd"
RECIPE = dict(dataset="fortunes", model="gpt", batch_size=16, optimizer="adamw", lr=3e-3, warmup="20",
              lr_schedule="cosine", eval_every=0.125, progress=False)  # fmt: skip


def run(spec: str, seed: int, args) -> tuple[dict, list[dict]]:
    strategy, _, update = spec.partition(":")
    options = {"update": update} if update else {}
    config = ako.TrainConfig(strategy=strategy, workers=args.workers, epochs=args.epochs, seed=seed,
                             out_dir=args.out_dir, **RECIPE, **options)  # fmt: skip
    summary = ako.train(config).summary
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


def time_to(records: list[dict], key: str, target: float) -> float | None:
    return next((r["time"] for r in records if r.get(key) is not None and r[key] <= target), None)


def shown(times: list[float | None]) -> str:
    """The median time, or "not reached" when a run did not reach the target."""
    return f"{statistics.median(times):.1f} s" if times and None not in times else "not reached"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=STRATEGIES)
    parser.add_argument("--target", type=float, default=2.5, help="validation loss, nats per character")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; medians over them")
    parser.add_argument("--out-dir", default="runs/benchmarks/lm")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"| strategy | time to loss <= {args.target} (rank 0) | vs allreduce | replicas' average | "
          f"loss after {args.epochs:g} epoch(s) | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    reference = None
    for spec in args.strategies.split(","):
        runs = [run(spec, seed, args) for seed in seeds]
        own = [time_to(records, "test_loss", args.target) for _, records in runs]
        average = [time_to(records, "average_loss", args.target) for _, records in runs]
        if spec == "allreduce":
            reference = own
        ratios = [a / b for a, b in zip(own, reference or []) if a is not None and b]
        ratio = f"{statistics.median(ratios):.2f}x" if reference and len(ratios) == len(own) else "-"
        differ = "average_loss" in runs[0][1][-1]
        loss = statistics.median(s["test_loss"] for s, _ in runs)
        tokens = statistics.median(s["tokens_per_second"] for s, _ in runs)
        print(f"| `{spec}` | {shown(own)} | {ratio} | {shown(average) if differ else '-'} | {loss:.3f} | {tokens:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
