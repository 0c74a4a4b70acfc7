"""The eight strategies of the papers on the language model, side by side in one run (`diloco`
and `streaming-diloco` too where --strategies names them): the gpt on Debian's fortunes,
4 workers on loopback, AdamW (lr 3e-3, 20 warm-up steps, cosine over the run), batch 16 a
worker (1 epoch = 283 steps): time to a validation loss (rank 0's replica, and the replicas'
average where they differ), its ratio to allreduce's, the loss at the end, and tokens/s.

    .venv/bin/python benchmarks/lm_strategies.py [--target 2.3,2.2] [--epochs 1.6] [--seeds 0]
        [--strategies allreduce,ako,gossip,bsp,ssp,asp,absp,easgd] [--out-dir DIR] [--reuse]

A strategy may be `ako:deltas` for Ako with --update deltas. Evaluations are of snapshots
every sixteenth of an epoch, evaluated after training; time is training seconds (rank 0's
clock). With several seeds each cell is the median over them, and "vs allreduce" the median
of each seed's ratio to allreduce's time with that seed (allreduce among --strategies).
Each run goes to `<out-dir>/<strategy>-seed<seed>/` (`ako-deltas-seed0` for `ako:deltas`); `--reuse` takes a run already there instead
of training again (a table for another target from the same runs). One table per target.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import ako
from run_records import latest_run, targets, time_to

STRATEGIES = "allreduce,ako,gossip,bsp,ssp,asp,absp,easgd"
RECIPE = dict(dataset="fortunes", model="gpt", batch_size=16, optimizer="adamw", lr=3e-3, warmup="20",
              lr_schedule="cosine", eval_every=0.0625, progress=False)  # fmt: skip


def run(spec: str, seed: int, args) -> tuple[dict, list[dict]]:
    """One run (or, with --reuse, the one already in its folder): its summary and records."""
    folder = Path(args.out_dir) / f"{spec.replace(':', '-')}-seed{seed}"
    if args.reuse and (done := latest_run(folder)):
        return done
    strategy, _, update = spec.partition(":")
    options = {"update": update} if update else {}
    config = ako.TrainConfig(strategy=strategy, workers=args.workers, epochs=args.epochs, seed=seed,
                             out_dir=str(folder), **RECIPE, **options)  # fmt: skip
    ako.train(config)
    return latest_run(folder)


def shown(times: list[float | None]) -> str:
    """The median time, or how many runs did not reach the target."""
    missed = sum(t is None for t in times)
    return f"not reached by {missed} of {len(times)}" if missed else f"{statistics.median(times):.1f} s"


def table(rows: dict[str, list], target: float, args) -> None:
    """The markdown table of every strategy's runs at `target`, then each seed's time."""
    print(f"\n| strategy | time to loss <= {target:g} (rank 0) | vs allreduce | replicas' average | "
          f"loss after {args.epochs:g} epoch(s) | training s | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    reference = [time_to(records, "test_loss", target) for _, records in rows.get("allreduce", [])]
    spread = []
    for spec, runs in rows.items():
        own = [time_to(records, "test_loss", target) for _, records in runs]
        average = [time_to(records, "average_loss", target) for _, records in runs]
        ratios = [a / b for a, b in zip(own, reference) if a is not None and b]
        ratio = f"{statistics.median(ratios):.2f}x" if reference and len(ratios) == len(own) else "-"
        differ = "average_loss" in runs[0][1][-1]
        loss = statistics.median(s["test_loss"] for s, _ in runs)
        seconds = statistics.median(s["train_seconds"] for s, _ in runs)
        tokens = statistics.median(s["tokens_per_second"] for s, _ in runs)
        print(f"| `{spec}` | {shown(own)} | {ratio} | {shown(average) if differ else '-'} | {loss:.3f} | {seconds:.0f} | "
              f"{tokens:.0f} |")  # fmt: skip
        spread.append(f"{spec}: " + ", ".join("-" if t is None else f"{t:.1f}" for t in own))
    print(f"\neach seed's time to {target:g} (s; seeds {args.seeds}):", *spread, sep="\n  ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=STRATEGIES)
    parser.add_argument("--target", type=targets, default=[2.3, 2.2],
                        help="validation loss(es), nats per character, comma-separated: a table each")
    parser.add_argument("--epochs", type=float, default=1.6)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; medians over them")
    parser.add_argument("--out-dir", default="runs/benchmarks/lm")
    parser.add_argument("--reuse", action="store_true", help="take the runs already in --out-dir instead of training")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = {}
    for spec in args.strategies.split(","):
        rows[spec] = [run(spec, seed, args) for seed in seeds]
        for seed, (summary, _) in zip(seeds, rows[spec]):
            print(f"{spec} seed {seed}: loss {summary['test_loss']:.3f} after {summary['train_seconds']:.0f} s", flush=True)
    for target in args.target:
        table(rows, target, args)


if __name__ == "__main__":
    main()
