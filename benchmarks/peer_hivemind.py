"""Peer arm `hivemind`: Hivemind 1.1.12's `hivemind.Optimizer` (decentralised parameter
averaging over its own DHT), one process per worker, as Hivemind's quickstart runs it.

Every worker process is started with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun
sets them), on one machine (127.0.0.1) or one per host. Rank 0 hosts a `torch.distributed.TCPStore`
at MASTER_ADDR:MASTER_PORT; it is used only to exchange addresses and for the start and end
barriers, never to move training data. Rank 0 starts the first DHT node, listening on its own
address (the one its route to MASTER_ADDR leaves from: 127.0.0.1 on one machine, eth0's address
on a host), and publishes its multiaddrs in the store; every other worker starts a DHT node on its
own address with those as `initial_peers`. From then on Hivemind finds its peers and averages by
itself (matchmaking over the DHT, butterfly all-reduce over libp2p); the training loop is the
one of Hivemind's quickstart: zero_grad, forward, backward, `opt.step()`.

Settings (in the result's `facts` too): Hivemind's quickstart (`use_local_updates=True`,
`target_batch_size=10000` with a batch of 32, `matchmaking_time=3.0`, `averaging_timeout=10.0`)
adapted to 4 workers x batch 64 on 100 Mbit/s links:

- `use_local_updates=True`: every worker steps ako's optimizer (SGD, lr 0.1, Nesterov 0.9,
  weight decay 5e-4) on its own gradient at every step, and the parameters are averaged once the
  workers together have done `target_batch_size` samples (a Hivemind "epoch"). The other mode
  (gradients accumulated to `target_batch_size`, then one averaged step) would make 2 epochs of
  Fashion-MNIST 12 optimizer steps at 10 000 samples, or, at 256 samples (one step of 4 x 64,
  synchronous SGD), a matchmaking round of a second or more for every 30-100 ms step.
- `target_batch_size=10240` (40 steps of 4 x 64, the quickstart's 10 000): about 6 rounds an
  epoch of Fashion-MNIST. The cnn's 206,922 float32 parameters are 0.83 MB; a round sends
  2 (n-1)/n of that, 1.24 MB, 0.1 s at 100 Mbit/s. A round is not free, though: with local
  updates Hivemind applies its result by the delta rule, and the next `opt.step()` waits for the
  round to finish (measured here: 0.6-2 s a round, mostly matchmaking); a Hivemind epoch must
  also be well longer than a round, or the progress tracker, which extrapolates the peers'
  sample rates, declares epochs faster than rounds finish and training stalls on every one
  (seen with 12-step epochs: 122 epochs in 320 steps).
- `matchmaking_time=1.0` s (the quickstart's 3 s and the docstring's "3-5 s for small local
  runs", shortened: 4 peers on one LAN find each other in well under a second, and the stall per
  round is about this long); `request_timeout=0.5` s (Hivemind warns unless it is below
  `matchmaking_time`).
- `averaging_timeout=5.0` s (the quickstart's 10 s halved; Hivemind's advice is about twice the
  time a round takes): a round with a peer that has left or died (always one at the end of a
  run: the first to finish leaves while another is matching with it) is given up after it.
- everything else Hivemind's defaults: `delay_state_averaging=True`, `average_state_every=1`,
  no compression (float32 on the wire), the optimizer's momentum not averaged. A worker that
  finds itself an epoch behind downloads the state from a peer (Hivemind does this for 1-3
  workers at the first epoch boundary, as they join).

Every worker leaves the collaboration (`opt.shutdown()`, Hivemind's "goodbye") as soon as it has
done its steps, and keeps its DHT node up until all are done, so that those still training stop
counting it. Hivemind runs 3 helper processes per worker (its DHT node, the `p2pd` daemon, the
averager), together about half a core here; they are made to end with their worker, however it
ends.

Bytes sent: the payload bytes of the tensor parts this worker sends in Hivemind's all-reduce
(its parts for the other peers, and the averaged parts it sends back), counted by wrapping
`AllReduceRunner`'s two senders before the averager process is forked (shared counters). DHT,
matchmaking and state-download messages are not counted. The result's figure is the mean over
the workers.

`train_seconds` runs from the start barrier until every worker has done its steps (rank 0 waits
for the others, or their death, before it evaluates). Rank 0's snapshots are its own replica.

Measured on this 2-core machine, 4 local workers, 2 epochs (shared with other jobs, so +-20%):
34.6-46.1 s of training, 2600-3500 samples/s, test accuracy 0.861-0.863 at the end (best
snapshot 0.874-0.884), first at 0.85 after 18-24 s, 9-10 rounds of 3.6-3.7 peers on average,
0.23-0.29 MB/s sent per worker, 10-11 s from start to training.

    RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 python benchmarks/peer_hivemind.py --out r.json
    python benchmarks/peer_hivemind.py --check   # 2 local workers, a few steps: exit 0 if the loss went down

Exit status: 0 done; 1 training failed or (`--check`) the loss did not go down, with one line
saying why; 3 this arm cannot run here (the import, or starting the store, DHT or optimizer
failed), with one line naming the error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_launch import (DEAD_AFTER, ENDING, Arm, CannotRun, Watchdog, hard_exit, join, leave,
                         loss_went_down, start_or_exit, verdict, wait_for)  # fmt: skip


def own_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="hivemind.Optimizer(verbose=True): log its rounds")


ARM = Arm(
    "hivemind", library="hivemind", doc=__doc__, own_arguments=own_arguments,
    settings={"target_batch_size": 10240, "matchmaking_time": 1.0, "averaging_timeout": 5.0},
    # --check: 2 workers, 6 epochs of 6400 samples (50 steps each, 300 in all; 6 Hivemind epochs of
    # 50 steps), a small test set and one snapshot an epoch: about 10 s of training.
    check={"workers": 2, "train_samples": 6400, "epochs": 6.0, "test_samples": 1000, "eval_every": 1.0,
           "target_batch_size": 6400, "matchmaking_time": 0.5},
)  # fmt: skip
PREFIX = ARM.prefix


class _DieWithParent:
    """Hivemind's helper processes (the DHT node, the averager; both forked by multiprocessing)
    end when their worker does, however it ends: each watches its parent from a thread and, once
    orphaned, kills its own descendants (the DHT node's p2pd) and exits. Without this a killed
    worker leaves them running, and the others see its DHT records for another minute."""

    def __init__(self):
        mp.util.register_after_fork(self, _DieWithParent._after_fork)

    @staticmethod
    def _after_fork(_self) -> None:
        parent = os.getppid()

        def watch():
            while os.getppid() == parent:
                time.sleep(1)
            hard_exit(1)

        threading.Thread(target=watch, daemon=True).start()


def count_allreduce_bytes():
    """Shared counters [payload bytes sent, all-reduce rounds done, peers summed over them],
    kept by wrapping Hivemind's all-reduce; the wrapping reaches the averager process, which is
    forked after it. None if the averager is not forked (then nothing can be counted)."""
    if mp.get_start_method(allow_none=False) != "fork":
        return None
    from hivemind.averaging import allreduce, averager

    counters = mp.Array("q", 3)
    runner, avg = allreduce.AllReduceRunner, averager.DecentralizedAverager
    send_parts, send_averaged, run_round = (runner._generate_input_for_peer, runner._accumulate_parts_streaming,
                                            avg._run_allreduce_inplace_)  # fmt: skip

    def add(i: int, n: int) -> None:
        with counters.get_lock():
            counters[i] += n

    async def _generate_input_for_peer(self, *a, **k):
        async with contextlib.aclosing(send_parts(self, *a, **k)) as messages:
            async for msg in messages:
                add(0, len(msg.tensor_part.buffer))
                yield msg

    async def _accumulate_parts_streaming(self, *a, **k):
        async with contextlib.aclosing(send_averaged(self, *a, **k)) as messages:
            async for msg in messages:
                add(0, len(msg.tensor_part.buffer))
                yield msg

    async def _run_allreduce_inplace_(self, tensors, group_info, *a, **k):
        result = await run_round(self, tensors, group_info, *a, **k)
        add(1, 1)
        add(2, len(group_info.peer_ids))
        return result

    runner._generate_input_for_peer = _generate_input_for_peer
    runner._accumulate_parts_streaming = _accumulate_parts_streaming
    avg._run_allreduce_inplace_ = _run_allreduce_inplace_
    return counters


def start(args, rank: int, world: int, watchdog: Watchdog):
    """Store, trainer, DHT and optimizer; raises CannotRun if any of them cannot start."""
    try:
        import torch
        import hivemind
        import peer_common
    except Exception as e:  # any import failure means: cannot run here
        raise CannotRun(f"import failed: {type(e).__name__}: {e}") from e
    try:
        host, store = join(PREFIX, rank, world, args.timeout)
        trainer = peer_common.Trainer(args, rank, world)
        counters = count_allreduce_bytes()
        _DieWithParent.guard = _DieWithParent()  # registered for as long as the class holds it
        watchdog.beat("starting the DHT")
        maddrs = [f"/ip4/{host}/tcp/0"]  # this host's address only: what it announces is reachable
        if rank == 0:
            dht = hivemind.DHT(host_maddrs=maddrs, start=True)
            store.set("hivemind/initial_peers", "\n".join(str(a) for a in dht.get_visible_maddrs()))
        else:
            store.wait(["hivemind/initial_peers"], timedelta(seconds=args.timeout))
            peers = store.get("hivemind/initial_peers").decode().split("\n")
            dht = hivemind.DHT(initial_peers=peers, host_maddrs=maddrs, start=True)
        watchdog.beat("starting hivemind.Optimizer")
        opt = hivemind.Optimizer(
            dht=dht, run_id="ako_peers", optimizer=trainer.optimizer(),
            batch_size_per_step=args.batch_size, target_batch_size=args.target_batch_size,
            use_local_updates=True, matchmaking_time=args.matchmaking_time,
            averaging_timeout=args.averaging_timeout, load_state_timeout=args.timeout / 2,
            averager_opts={"request_timeout": args.matchmaking_time / 2}, verbose=args.verbose,
        )  # fmt: skip
    except Exception as e:
        raise CannotRun(f"start failed: {type(e).__name__}: {e}") from e
    return torch, hivemind, store, trainer, dht, opt, counters


def run_worker(args) -> int:
    import peer_common

    rank, world = peer_common.env_rank()
    watchdog = Watchdog(PREFIX, rank, args.timeout + DEAD_AFTER + 30)  # later than any of our own waits
    torch, hivemind, store, trainer, dht, opt, counters = start_or_exit(PREFIX, start, args, rank, world, watchdog)
    try:
        startup = time.perf_counter() - START
        trainer.begin()
        model, losses = trainer.model, []
        for step in range(trainer.steps):
            opt.zero_grad()
            loss = trainer.loss(model, step)
            trainer.straggle()  # the straggler's sleep, between forward and backward
            loss.backward()
            opt.step()
            losses.append(loss.item())
            trainer.after_step(step + 1)
            watchdog.beat(f"step {step + 1}")
        own_seconds, epoch = time.perf_counter() - trainer.start, opt.local_epoch
        # leave the collaboration at once (Hivemind's "goodbye"): peers still training would
        # otherwise wait for this one, averaging_timeout, in the rounds they start
        watchdog.beat("hivemind.Optimizer.shutdown")
        opt.shutdown()
        store.set(f"done/{rank}", json.dumps(None if counters is None else counters[0]))
    except Exception as e:
        hard_exit(1, f"{PREFIX}: rank {rank}: training failed: {type(e).__name__}: {e}")
    if rank != 0:
        ENDING.set()
        # keep this DHT node up until every worker is done: its goodbye (and the routes of the
        # others' DHT records) must reach the peers still training
        watchdog.beat("waiting for rank 0 to see every worker done")
        with contextlib.suppress(Exception):
            store.wait(["finished"], timedelta(seconds=args.timeout + DEAD_AFTER + 5))
        with contextlib.suppress(Exception):
            dht.shutdown()
        with contextlib.suppress(Exception):
            store.set(f"closed/{rank}", "1")
        hard_exit(0)

    # rank 0: wait for the others (or their death), evaluate, write the result
    watchdog.beat("waiting for the other workers to finish")
    done, gone = wait_for(store, "done", world, args.timeout)
    store.set("finished", "1")
    sent = [b for b in map(json.loads, done.values()) if b is not None]
    down, first, last = loss_went_down(losses)
    rounds = None if counters is None else counters[1]
    facts = {
        "library": f"hivemind {hivemind.__version__}", "torch": torch.__version__,
        "optimizer": "hivemind.Optimizer(use_local_updates=True) over ako's SGD",
        "settings": f"local updates, target_batch_size {args.target_batch_size}, matchmaking {args.matchmaking_time:g} s, "
                    f"averaging_timeout {args.averaging_timeout:g} s",
        "target_batch_size": args.target_batch_size, "batch_size_per_step": args.batch_size,
        "use_local_updates": True, "matchmaking_time": args.matchmaking_time,
        "averaging_timeout": args.averaging_timeout, "request_timeout": args.matchmaking_time / 2,
        "delay_state_averaging": True, "average_state_every": 1, "compression": "none (float32)",
        "discovery": "hivemind.DHT, bootstrapped from rank 0's multiaddrs (exchanged through the job's TCPStore)",
        "hivemind_epochs": epoch, "averaging_rounds_rank0": rounds,
        "mean_group_size_rank0": round(counters[2] / counters[1], 2) if rounds else None,
        "bytes_sent_per_worker": {str(r): json.loads(v) for r, v in sorted(done.items())},
        "bytes_counted": "payload of the all-reduce tensor parts each worker sent (DHT, matchmaking and state downloads not counted)",
        "workers_finished": len(done), "workers_lost": gone, "startup_seconds": round(startup, 2),
        "rank0_steps_seconds": round(own_seconds, 3), "first_loss": round(first, 4), "last_loss": round(last, 4),
    }  # fmt: skip
    watchdog.beat("evaluating rank 0's snapshots")
    result = trainer.finish(ARM.name, round(sum(sent) / len(sent)) if sent else None, facts=facts) if args.out else None
    code = verdict(PREFIX, args.check, (down, first, last), rounds, f"{rounds} averaging rounds", result, trainer.steps,
                   world, gone)  # fmt: skip
    watchdog.beat("waiting for the other workers to close")
    leave(store, world, gone, dht.shutdown)
    hard_exit(code)  # Hivemind's helper processes and threads must not hold the exit


def main() -> int:
    return ARM.main(__file__, run_worker)


if __name__ == "__main__":
    sys.exit(main())
