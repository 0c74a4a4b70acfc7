"""How long an all-reduce started in the background takes while its workers compute, against
while they sleep: what overlapping communication with computation buys on this machine.

    .venv/bin/python benchmarks/overlap.py [--workers 2,4] [--kib 104] [--micro-batch 8] [--rounds 40]

Each worker (one process, one torch thread, started as torchrun would) starts an async Gloo
all-reduce of `--kib` KiB (default: Ako's window of the cnn's 0.83 MB gradient at p = 8) and
then either sleeps in 1.5 ms ticks or computes the cnn's forward/backward on micro-batches of
`--micro-batch` Fashion-MNIST-shaped samples, checking after each tick whether the all-reduce is
done (so a tick bounds how late it is seen: 8 samples take about 1-2 ms here). Prints
the median time to completion of each, side by side for each worker count. With more workers
than cores (4 on this machine's 2), Gloo's threads wait for the cores behind the computation,
which is why Ako's ring gains nothing from overlap in benchmarks/peers.py (docs/results.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ako.models import build_model
from ako.runtime.distributed.launcher import launch_function

TICK = 0.0015  # seconds of one sleep tick


def worker(numel: int, rounds: int, micro_batch: int) -> dict:
    """Median seconds to completion of a background all-reduce of `numel` floats, while the
    main thread sleeps and while it computes; measured on rank 0 after a barrier each round."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=60)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    model = build_model("cnn", (1, 28, 28), 10)
    x, y = torch.randn(micro_batch, 1, 28, 28), torch.randint(0, 10, (micro_batch,))
    buffer = torch.ones(numel)

    def compute():
        F.cross_entropy(model(x), y).backward()

    medians = {}
    for name, tick in (("sleeping", lambda: time.sleep(TICK)), ("computing", compute)):
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            work = dist.all_reduce(buffer, async_op=True)
            while not work.is_completed():
                tick()
            times.append(time.perf_counter() - start)
            work.wait()
        medians[name] = statistics.median(times[rounds // 4 :])  # the first rounds warm up
    dist.destroy_process_group()
    return medians


def check(args) -> tuple[list[int], int]:
    """The worker counts and the floats all-reduced; exits 2 with one line naming a bad value."""
    def bad(message: str):
        print(f"overlap.py: {message}", file=sys.stderr)
        sys.exit(2)

    texts = args.workers.split(",")
    if not all(t.strip().isdigit() and 2 <= int(t) <= 64 for t in texts) or len(set(texts)) != len(texts):
        bad(f"--workers {args.workers!r}: distinct comma-separated counts from 2 to 64, like 2,4")
    if not 0.004 <= args.kib <= 1 << 20:  # also refuses nan
        bad(f"--kib {args.kib:g}: from 0.004 (one float) to 1048576 (1 GiB)")
    if not 1 <= args.micro_batch <= 4096:
        bad(f"--micro-batch {args.micro_batch}: from 1 to 4096 samples")
    if not 4 <= args.rounds <= 100_000:
        bad(f"--rounds {args.rounds}: from 4 to 100000")
    return [int(t) for t in texts], int(args.kib * 1024 / 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    parser.add_argument("--kib", type=float, default=104.0, help="KiB all-reduced")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples of one compute tick")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    counts, numel = check(args)
    print(f"background all-reduce of {args.kib:g} KiB, {os.cpu_count()} cores, "
          f"computing on {args.micro_batch} samples a tick, median of {args.rounds} rounds")  # fmt: skip
    print(f"{'workers':>8} {'sleeping':>10} {'computing':>10} {'ratio':>7}")
    try:
        for n in counts:
            m = launch_function(worker, n, numel, args.rounds, args.micro_batch)[0]
            print(f"{n:>8} {m['sleeping'] * 1e3:>8.1f}ms {m['computing'] * 1e3:>8.1f}ms {m['computing'] / m['sleeping']:>6.1f}x")
    except KeyboardInterrupt:
        print("overlap.py: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
