"""Peer arm `torchft`: torchft 0.2.0's fault-tolerant LocalSGD (`torchft.local_sgd.LocalSGD`
under a `torchft.Manager`, a `ProcessGroupGloo` and a lighthouse), one process per worker, each
worker its own replica group of size 1, as torchft's LocalSGD example runs it. With
`--algorithm diloco` or `streaming-diloco`, torchft's `DiLoCo` (arms `torchft-diloco` and
`torchft-streaming-diloco`) in its place: the run's optimizer as the inner one, an outer SGD
with Nesterov momentum (`--outer-lr` 0.7, `--outer-momentum` 0.9) per fragment, `--sync-every`
H, and for streaming `--fragments` P of whole modules cut as ako's `--fragment-cut modules`
cuts them (unit u in fragment u mod P), `--fragment-delay` tau and `--fragment-alpha`; the
Manager with a synchronous quorum, as DiLoCo requires. Against ako's `diloco` and
`streaming-diloco` with the same settings this checks that ours is the algorithm.

Every worker process is started with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun
sets them), on one machine (127.0.0.1) or one per host. Rank 0 hosts a `torch.distributed.TCPStore`
at MASTER_ADDR:MASTER_PORT, used only to exchange addresses and for the start and end barriers.
Rank 0 starts torchft's lighthouse (`torchft.coordination.LighthouseServer`, what the
`torchft_lighthouse` binary runs) on all interfaces and publishes `http://<its address>:<port>`
in the store. Every worker is one replica group of size 1, as torchft's examples run DDP and
LocalSGD ("for DDP we can use replica groups of size 1"): it hosts its group's own TCPStore on
its own address (the Manager's store, and the one the quorum's Gloo group meets in when it is
the quorum's first replica), and runs a `torchft.Manager` (group rank 0 of 1, `replica_id`
`ako_<rank>`, advertised at its own address) over a `ProcessGroupGloo`, whose sockets use the
interface of that address (`GLOO_SOCKET_IFNAME`, unless set: lo on one machine, eth0 on a host).
The training loop is the one of torchft's LocalSGD example: zero_grad, forward, backward,
`optimizer.step()`, inside `with LocalSGD(manager, model, optimizer, sync_every)`.

Settings (in the result's `facts` too), from torchft's LocalSGD example and README
(`torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`,
`ProcessGroupGloo(timeout=5 s)`, `Manager(min_replica_size=1, timeout=30 s)`, `PGTransport`)
adapted to 4 workers x batch 64 on 100 Mbit/s links:

- LocalSGD by default (the arm `torchft`): it keeps ako's optimizer (SGD, lr 0.1, Nesterov 0.9,
  weight decay 5e-4) as the only one and averages the parameters every `sync_every` steps;
  DiLoCo (`--algorithm`, above) adds an outer optimizer, a different algorithm with its own
  hyperparameters, compared with ako's own `diloco` rather than with Ako.
- `sync_every=8` (the example's 100 is for a 1 GB model; 5 in its quick run): a sync is a quorum
  at the lighthouse (up to a 100 ms tick), 8 Gloo all-reduces (one a parameter, 0.83 MB in all,
  each worker sending 2 (n-1)/n of it: 1.24 MB, 0.1 s at 100 Mbit/s) and a commit vote, about
  0.1-0.3 s, against 8 steps of 30-40 ms; local SGD with 8 local steps trains the cnn about as
  well as synchronous SGD (below).
- lighthouse `min_replicas=1`, `join_timeout_ms=10000`, `quorum_tick_ms=100` (the README's),
  `heartbeat_timeout_ms=5000` (torchft's default): a quorum waits for every replica that
  heartbeats (a straggler too) up to 10 s, so every sync includes every live worker, and a dead
  one is dropped from the next quorum; the survivors go on (torchft's fault tolerance).
- `Manager(min_replica_size=1, init_sync=False, timeout=30 s, quorum_timeout=--timeout,
  connect_timeout=10 s)`, `ProcessGroupGloo(timeout=10 s)`, `PGTransport` for recovery:
  `init_sync=False` because every worker builds the same initial model from the seed (torchft's
  advice), so no checkpoint moves at step 0.
- `RUST_LOG=warn` unless set: torchft's lighthouse and managers log every quorum at info.

Bytes sent: counted as a ring all-reduce moves them (as ako counts its own collectives):
2 (n-1)/n x the bytes of every tensor LocalSGD or DiLoCo hands to `manager.allreduce`, n the replicas of
that quorum; Gloo's own traffic is not observable from Python. The result's figure is the mean
over the workers.

`train_seconds` runs from the start barrier until every worker has done its steps (rank 0 waits
for the others, or their death, before it evaluates). Rank 0's snapshots are its own replica
(between syncs the replicas differ).

Measured on this 2-core machine, 4 local workers, 2 epochs (shared with other jobs, so +-20%):
15.9-19.6 s of training, 6100-7500 samples/s, test accuracy 0.8715 at the end (best snapshot
0.881), first at 0.85 after 6.5-7.9 s, 58 of 58 syncs committed, 3.7-4.5 MB/s sent per worker,
7-9 s from start to training.

    RANK=0 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 python benchmarks/peer_torchft.py --out r.json
    python benchmarks/peer_torchft.py --check   # 2 local workers, a few steps: exit 0 if the loss went down

Exit status: 0 done; 1 training failed or (`--check`) the loss did not go down, with one line
saying why; 3 this arm cannot run here (the import, or starting the store, lighthouse or
Manager failed), with one line naming the error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_launch import (DEAD_AFTER, ENDING, Arm, CannotRun, Watchdog, hard_exit, join, leave,
                         loss_went_down, start_or_exit, verdict, wait_for)  # fmt: skip

ALGORITHMS = ("localsgd", "diloco", "streaming-diloco")


def own_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--algorithm", choices=ALGORITHMS, default="localsgd",
                   help="torchft's LocalSGD (default), or its DiLoCo with one fragment or with --fragments")  # fmt: skip


ARM = Arm(
    "torchft", library="torchft", doc=__doc__, own_arguments=own_arguments,
    settings={"sync_every": 8, "quorum_tick_ms": 100, "join_timeout_ms": 10000, "heartbeat_timeout_ms": 5000,
              "pg_timeout": 10.0, "fragments": 1, "fragment_delay": 0, "fragment_alpha": 0.0, "outer_lr": 0.7,
              "outer_momentum": 0.9},
    # --check: 2 workers, 2 epochs of 4096 samples (64 steps each, 8 syncs), a small test set and
    # one snapshot an epoch.
    check={"workers": 2, "train_samples": 4096, "epochs": 2.0, "test_samples": 1000, "eval_every": 1.0},
)  # fmt: skip
PREFIX = ARM.prefix


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 `address` (Linux), or None."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def arm_name(args) -> str:
    """The result's arm: torchft (LocalSGD), torchft-diloco or torchft-streaming-diloco."""
    return "torchft" if args.algorithm == "localsgd" else f"torchft-{args.algorithm}"


def module_fragments(model, p: int) -> list:
    """`p` fragments of `model` (torch.nn.ModuleList each) of whole modules, as ako's
    `--fragment-cut modules` cuts the flat vector: the model's units in order, unit u in
    fragment u mod p (`ako.strategies.diloco.module_units`)."""
    import torch
    from ako.strategies.diloco import module_units

    units = list(module_units(model))
    if len(units) < p:
        raise ValueError(f"fragments {p}: the model has only {len(units)} modules ({', '.join(units)})")
    return [torch.nn.ModuleList([model.get_submodule(u) for u in units[k::p]]) for k in range(p)]


def synchronisation(args, manager, model, optimizer):
    """torchft's LocalSGD or DiLoCo (per --algorithm) over `optimizer`'s step."""
    import torch
    from torchft.local_sgd import DiLoCo, LocalSGD

    if args.algorithm == "localsgd":
        return LocalSGD(manager, model, optimizer, sync_every=args.sync_every)
    fragments = module_fragments(model, args.fragments if args.algorithm == "streaming-diloco" else 1)
    outer = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
             for f in fragments]  # fmt: skip
    streaming = args.algorithm == "streaming-diloco"
    return DiLoCo(manager, fragments, optimizer, outer, sync_every=args.sync_every,
                  fragment_sync_delay=args.fragment_delay if streaming else 0,
                  fragment_update_alpha=args.fragment_alpha if streaming else 0.0)  # fmt: skip


def start(args, rank: int, world: int, watchdog: Watchdog):
    """Store, trainer, lighthouse (rank 0), Manager and the synchronisation (LocalSGD or
    DiLoCo); raises CannotRun if any of them cannot start."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and manager log every quorum at info
    try:
        import torch
        import torchft
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.coordination import LighthouseServer
        import peer_common
    except Exception as e:  # any import failure means: cannot run here
        raise CannotRun(f"import failed: {type(e).__name__}: {e}") from e
    try:
        host, store = join(PREFIX, rank, world, args.timeout)
        # Gloo's sockets go out of the interface that holds this host's address (eth0 on a host,
        # lo on one machine) unless the caller chose one
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(host) or "")
        if not os.environ["GLOO_SOCKET_IFNAME"]:
            del os.environ["GLOO_SOCKET_IFNAME"]
        trainer = peer_common.Trainer(args, rank, world)
        lighthouse = None
        if rank == 0:
            watchdog.beat("starting the lighthouse")
            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=args.join_timeout_ms,
                                          quorum_tick_ms=args.quorum_tick_ms,
                                          heartbeat_timeout_ms=args.heartbeat_timeout_ms)  # fmt: skip
            address = f"http://{host}:{lighthouse.address().rsplit(':', 1)[1]}"
            store.set("torchft/lighthouse", address)
        else:
            store.wait(["torchft/lighthouse"], timedelta(seconds=args.timeout))
            address = store.get("torchft/lighthouse").decode()
        # this replica group's own store (the Manager's and, on the quorum's first replica, the
        # store every replica's Gloo group meets in), on this host's address
        group_store = TCPStore(host, 0, 1, is_master=True, timeout=timedelta(seconds=args.timeout),
                               wait_for_workers=False)  # fmt: skip
        model, optimizer = trainer.model, trainer.optimizer()
        pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))

        def state_dict():
            return {"model": model.state_dict(), "optim": optimizer.state_dict()}

        def load_state_dict(state):
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])

        watchdog.beat("starting torchft.Manager")
        manager = Manager(
            pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
            replica_id=f"ako_{rank}", lighthouse_addr=address, hostname=host,
            store_addr=host, store_port=group_store.port, rank=0, world_size=1,
            checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=args.timeout), device=torch.device("cpu")),
            timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=args.timeout),
            connect_timeout=timedelta(seconds=10), init_sync=False,
            use_async_quorum=args.algorithm == "localsgd",  # DiLoCo needs a synchronous quorum
        )  # fmt: skip
        sent = count_allreduce_bytes(manager)
        local_sgd = synchronisation(args, manager, model, optimizer)
    except Exception as e:
        raise CannotRun(f"start failed: {type(e).__name__}: {e}") from e
    return torch, torchft, store, trainer, lighthouse, group_store, manager, optimizer, local_sgd, sent


def settings(args) -> str:
    """The arm's settings in one line (the table's last column)."""
    group = f"replica groups of 1, Gloo, lighthouse tick {args.quorum_tick_ms} ms"
    if args.algorithm == "localsgd":
        return f"LocalSGD sync_every {args.sync_every}, {group}"
    fragments = (f", {args.fragments} module fragments, delay {args.fragment_delay}, alpha {args.fragment_alpha:g}"
                 if args.algorithm == "streaming-diloco" else "")  # fmt: skip
    return (f"DiLoCo H {args.sync_every}, outer lr {args.outer_lr:g} momentum {args.outer_momentum:g}"
            f"{fragments}, {group}")  # fmt: skip


def count_allreduce_bytes(manager) -> list[int]:
    """[bytes]: what this worker sends in the Manager's all-reduces, counted as a ring all-reduce
    moves them (2 (n-1)/n x the tensor's bytes, n the quorum's replicas; as ako counts its own
    collectives); an all-reduce skipped after an error counts nothing."""
    sent, allreduce = [0], manager.allreduce

    def counting(tensor, *a, **k):
        work = allreduce(tensor, *a, **k)
        n = manager.num_participants()
        if not manager.errored() and n > 1:
            sent[0] += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
        return work

    manager.allreduce = counting
    return sent


def run_worker(args) -> int:
    import peer_common

    rank, world = peer_common.env_rank()
    watchdog = Watchdog(PREFIX, rank, args.timeout + DEAD_AFTER + 30)  # later than any of our own waits
    torch, torchft, store, trainer, lighthouse, group_store, manager, optimizer, local_sgd, sent = start_or_exit(
        PREFIX, start, args, rank, world, watchdog)  # fmt: skip
    try:
        startup = time.perf_counter() - START
        trainer.begin()
        model, losses = trainer.model, []
        scheduler = trainer.scheduler(optimizer)
        with local_sgd:
            for step in range(trainer.steps):
                optimizer.zero_grad()
                loss = trainer.loss(model, step)
                trainer.straggle()  # the straggler's sleep, between forward and backward
                loss.backward()
                optimizer.step()  # LocalSGD's or DiLoCo's hook: every sync_every steps, quorum + sync
                if scheduler is not None:
                    scheduler.step()
                losses.append(loss.item())
                trainer.after_step(step + 1)
                watchdog.beat(f"step {step + 1}")
        own_seconds = time.perf_counter() - trainer.start
        store.set(f"done/{rank}", json.dumps(sent[0]))
    except Exception as e:
        hard_exit(1, f"{PREFIX}: rank {rank}: training failed: {type(e).__name__}: {e}")
    if rank != 0:  # every worker syncs at the same steps: after its last one nobody waits for it
        ENDING.set()
        with contextlib.suppress(Exception):
            manager.shutdown(wait=False)
        with contextlib.suppress(Exception):
            store.set(f"closed/{rank}", "1")
        hard_exit(0)

    # rank 0: wait for the others (or their death), evaluate, write the result
    watchdog.beat("waiting for the other workers to finish")
    done, gone = wait_for(store, "done", world, args.timeout)
    sent_all = [json.loads(v) for v in done.values()]
    down, first, last = loss_went_down(losses)
    per_sync = args.sync_every // (args.fragments if args.algorithm == "streaming-diloco" else 1)  # a fragment's
    syncs, due = manager.current_step(), trainer.steps // per_sync
    facts = {
        "library": f"torchft {version('torchft')}", "torch": torch.__version__,
        "optimizer": f"torchft.local_sgd.{type(local_sgd).__name__} over {type(optimizer).__name__}",
        "sync_every": args.sync_every, "settings": settings(args),
        "replica_groups": world, "replica_group_size": 1, "process_group": "torchft.ProcessGroupGloo",
        "pg_timeout": args.pg_timeout, "min_replica_size": 1, "init_sync": False, "use_async_quorum": args.algorithm == "localsgd",
        "checkpoint_transport": "PGTransport",
        "lighthouse": {"min_replicas": 1, "quorum_tick_ms": args.quorum_tick_ms, "join_timeout_ms": args.join_timeout_ms,
                       "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "started_by": "rank 0 (torchft.coordination.LighthouseServer)"},
        "discovery": "torchft lighthouse at rank 0; its address through the job's TCPStore",
        "syncs_committed_rank0": syncs, "syncs_due": due, "batches_committed_rank0": manager.batches_committed(),
        "bytes_sent_per_worker": {str(r): json.loads(v) for r, v in sorted(done.items())},
        "bytes_counted": "2 (n-1)/n x the bytes of each tensor LocalSGD or DiLoCo all-reduced (a ring all-reduce's share; n: the quorum's replicas)",
        "workers_finished": len(done), "workers_lost": gone, "startup_seconds": round(startup, 2),
        "rank0_steps_seconds": round(own_seconds, 3), "first_loss": round(first, 4), "last_loss": round(last, 4),
    }  # fmt: skip
    watchdog.beat("evaluating rank 0's snapshots")
    mean_sent = round(sum(sent_all) / len(sent_all)) if sent_all else None
    result = trainer.finish(arm_name(args), mean_sent, facts=facts) if args.out else None
    code = verdict(PREFIX, args.check, (down, first, last), syncs, f"{syncs} of {due} syncs committed", result,
                   trainer.steps, world, gone)  # fmt: skip
    watchdog.beat("waiting for the other workers to close")
    leave(store, world, gone, lambda: manager.shutdown(wait=False), lighthouse.shutdown)
    hard_exit(code)  # torchft's threads must not hold the exit


def main() -> int:
    return ARM.main(__file__, run_worker)


if __name__ == "__main__":
    sys.exit(main())
