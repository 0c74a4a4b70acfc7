"""Peer arm `torchft`: torchft 0.2.0's fault-tolerant LocalSGD (`torchft.local_sgd.LocalSGD`
under a `torchft.Manager`, a `ProcessGroupGloo` and a lighthouse), one process per worker, each
worker its own replica group of size 1, as torchft's LocalSGD example runs it.

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

- LocalSGD, not DiLoCo: LocalSGD keeps ako's optimizer (SGD, lr 0.1, Nesterov 0.9, weight decay
  5e-4) as the only one and averages the parameters every `sync_every` steps; DiLoCo would add
  an outer optimizer (its example: SGD lr 0.7, Nesterov 0.9, over AdamW inner steps and
  `sync_every=100`), a different algorithm with its own hyperparameters to tune.
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
2 (n-1)/n x the bytes of every tensor LocalSGD hands to `manager.allreduce`, n the replicas of
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
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

START = time.perf_counter()
ARM = "torchft"
PREFIX = f"peer_{ARM}"
sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = {
    "sync_every": 8,
    "quorum_tick_ms": 100,
    "join_timeout_ms": 10000,
    "heartbeat_timeout_ms": 5000,
    "pg_timeout": 10.0,
}
# --check: 2 workers, 2 epochs of 4096 samples (64 steps each, 8 syncs), a small test set and
# one snapshot an epoch.
CHECK = {"workers": 2, "train_samples": 4096, "epochs": 2.0, "test_samples": 1000, "eval_every": 1.0}
COMMON_DEFAULTS = dict.fromkeys(("epochs", "train_samples", "test_samples", "eval_every"))  # add_arguments'


class CannotRun(Exception):
    """The arm cannot run here (exit 3)."""


# ---- the same small helpers as peer_hivemind.py --------------------------------------------

DEAD_AFTER = 10.0  # s: a worker whose heartbeat in the store stopped this long ago is gone


def own_address(master: str) -> str:
    """This host's address on the route to `master` (127.0.0.1 for a local master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master), 9))  # UDP: no packet is sent
        return s.getsockname()[0]


def connect_store(host: str, port: int, rank: int, world: int, timeout: float, master: bool | None = None):
    """The job's TCPStore (rank 0 hosts it) within `timeout` s: the constructor's handshake has
    no timeout of its own, so it runs on a daemon thread."""
    from torch.distributed import TCPStore

    result: list = []
    master = rank == 0 if master is None else master

    def connect():
        try:
            result.append(TCPStore(host, port, world, is_master=master, timeout=timedelta(seconds=timeout),
                                   wait_for_workers=False))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - handed on below
            result.append(e)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout + 5)
    if not result:
        raise TimeoutError(f"no answer from the store at {host}:{port} within {timeout + 5:.0f} s")
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


ENDING = threading.Event()  # set when this worker starts to leave: the store may go now


def heartbeat(host: str, port: int, rank: int, world: int, timeout: float) -> None:
    """Count `alive/<rank>` up in the store every second, on a thread with its own connection:
    rank 0 tells a dead worker from a slow one by it. If the store goes before this worker
    leaves, rank 0 is gone (and with it the job's result): end at once, with one line."""
    store = connect_store(host, port, rank, world, timeout, master=False)

    def beat():
        try:
            while True:
                store.add(f"alive/{rank}", 1)
                time.sleep(1)
        except Exception as e:  # noqa: BLE001
            if not ENDING.is_set():
                hard_exit(1, f"{PREFIX}: rank {rank}: the job's store at {host}:{port} is gone (did rank 0 end?): {type(e).__name__}")

    threading.Thread(target=beat, daemon=True).start()


def wait_for(store, key: str, world: int, timeout: float, gone_before=()) -> tuple[dict[int, str], list[int]]:
    """Rank 0: wait until every worker has set `key/<rank>` or is gone (its heartbeat stopped
    DEAD_AFTER s ago, or it is in `gone_before`), `timeout` s at most. Returns ({rank: value} of
    those that set it, the ranks that did not)."""
    deadline, found, seen = time.monotonic() + timeout, {}, {}
    while True:
        now, gone = time.monotonic(), []
        for r in range(world):
            if r not in found and store.check([f"{key}/{r}"]):
                found[r] = store.get(f"{key}/{r}").decode()
            if r not in found and r in gone_before:
                gone.append(r)
            elif r not in found:
                beats = store.add(f"alive/{r}", 0)
                if seen.get(r, (None,))[0] != beats:
                    seen[r] = (beats, now)
                elif now - seen[r][1] > DEAD_AFTER:
                    gone.append(r)
        missing = [r for r in range(world) if r not in found]
        if len(gone) == len(missing) or now > deadline:
            return found, missing
        time.sleep(0.1)


def start_together(store, rank: int, world: int, timeout: float) -> None:
    """The start barrier: rank 0 waits for every worker, then says go (or why not, and every
    worker raises CannotRun)."""
    store.set(f"started/{rank}", "1")
    if rank == 0:
        _, missing = wait_for(store, "started", world, timeout)
        why = f"ranks {missing} did not start (no heartbeat for {DEAD_AFTER:.0f} s, or not ready within {timeout:.0f} s)"
        store.set("go", why if missing else "")
    store.wait(["go"], timedelta(seconds=timeout + DEAD_AFTER + 5))
    if why := store.get("go").decode():
        raise CannotRun(why)


def descendants() -> list[int]:

    """PIDs of this process's descendants (its children, theirs, ...), from /proc."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = [], [os.getpid()]
    while frontier:
        kids = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += kids
        frontier = kids
    return found


def hard_exit(code: int, line: str | None = None) -> None:
    """Print `line`, kill this process's own descendants (the library's helper processes), exit."""
    if line:
        print(line, flush=True)
    for pid in descendants():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """Ends the process (exit 1, one line) when `beat` was not called for `seconds`: a stuck
    library call (a wait without a timeout of its own) cannot hang the run."""

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds, self.last, self.doing = rank, seconds, time.monotonic(), "starting"
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self, doing: str) -> None:
        self.last, self.doing = time.monotonic(), doing

    def _watch(self) -> None:
        while True:
            time.sleep(1)
            if time.monotonic() - self.last > self.seconds:
                hard_exit(1, f"{PREFIX}: rank {self.rank}: no progress for {self.seconds:.0f} s ({self.doing}); giving up")


def parser() -> argparse.ArgumentParser:
    """add_arguments' flags, --check, --timeout, one flag for each of SETTINGS, and the arm's own."""
    import peer_common

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer_common.add_arguments(p)
    for action in p._actions:  # --out: not needed by --check's launcher
        if action.dest == "out":
            action.required, action.default = False, None
    COMMON_DEFAULTS.update({key: p.get_default(key) for key in COMMON_DEFAULTS})
    p.set_defaults(**dict.fromkeys(COMMON_DEFAULTS))  # None: add_arguments' default, or --check's
    p.add_argument("--check", action="store_true", help="2 local workers, a few steps: exit 0 if the loss went down")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any wait may take: start-up, a stalled step, the end barrier")  # fmt: skip
    for key, value in SETTINGS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None, help=f"default {value}")
    own_arguments(p)
    return p


def fill_defaults(args) -> None:
    check = CHECK if args.check else {}
    for key, default in {**COMMON_DEFAULTS, **SETTINGS}.items():
        if getattr(args, key) is None:
            setattr(args, key, check.get(key, default))


def loss_went_down(losses: list[float]) -> tuple[bool, float, float]:
    """(last < first, first, last): the mean training loss of the first and last 5 steps."""
    k = max(1, min(5, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return last < first, first, last


def launch_check(script: str, argv: list[str], workers: int, timeout: float) -> int:
    """--check without RANK: run `workers` local worker processes of `script --check` and return
    their verdict (rank 0's line and exit status; 3 if a worker could not start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-check-"))
    out = tmp / "result.json"
    procs, logs = [], []
    for rank in range(workers):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        log = open(tmp / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, *argv, "--out", str(out)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
    codes = [p.poll() for p in procs]
    for p, code in zip(procs, codes):
        if code is None:  # our own worker: its whole group (its library's helpers too)
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def last_line(rank: int) -> str:
        logs[rank].seek(0)
        lines = [line.strip() for line in logs[rank] if line.strip()]
        ours = [line for line in lines if line.startswith(PREFIX)]
        return (ours or lines or [f"{PREFIX}: rank {rank} printed nothing"])[-1]

    try:
        for rank, code in enumerate(codes):
            if code == 3:
                print(last_line(rank))
                return 3
        if None in codes:
            print(f"{PREFIX}: check: timed out after {timeout:.0f} s (exit codes {codes}; logs in {tmp})")
            return 1
        for rank, code in enumerate(codes):
            if code != 0 and rank != 0:
                print(f"{PREFIX}: check: rank {rank} failed (exit {code}): {last_line(rank)} (logs in {tmp})")
                return 1
        print(last_line(0) + ("" if codes[0] == 0 else f" (logs in {tmp})"))
        return codes[0]
    finally:
        for log in logs:
            log.close()
        if codes == [0] * workers:
            shutil.rmtree(tmp, ignore_errors=True)


# ---- the torchft arm ----------------------------------------------------------------------


def own_arguments(p: argparse.ArgumentParser) -> None:
    """torchft's arm has no flags beyond SETTINGS' (--sync-every, --quorum-tick-ms, ...)."""


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


def start(args, rank: int, world: int, watchdog: Watchdog):
    """Store, trainer, lighthouse (rank 0), Manager and LocalSGD; raises CannotRun if any of them
    cannot start."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and manager log every quorum at info
    try:
        import torch
        import torchft
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import LocalSGD
        import peer_common
    except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
        raise CannotRun(f"import failed: {type(e).__name__}: {e}") from e
    master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        host = own_address(master)
        # Gloo's sockets go out of the interface that holds this host's address (eth0 on a host,
        # lo on one machine) unless the caller chose one
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface_of(host) or "")
        if not os.environ["GLOO_SOCKET_IFNAME"]:
            del os.environ["GLOO_SOCKET_IFNAME"]
        store = connect_store(master, port, rank, world, args.timeout)
        heartbeat(master, port, rank, world, args.timeout)
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
        )  # fmt: skip
        sent = count_allreduce_bytes(manager)
        local_sgd = LocalSGD(manager, model, optimizer, sync_every=args.sync_every)
    except Exception as e:  # noqa: BLE001
        raise CannotRun(f"start failed: {type(e).__name__}: {e}") from e
    return torch, torchft, store, trainer, lighthouse, group_store, manager, optimizer, local_sgd, sent


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
    watchdog = Watchdog(rank, args.timeout + DEAD_AFTER + 30)  # later than any of our own waits
    try:
        torch, torchft, store, trainer, lighthouse, group_store, manager, optimizer, local_sgd, sent = start(
            args, rank, world, watchdog)  # fmt: skip
        watchdog.beat("start barrier")
        start_together(store, rank, world, args.timeout)
    except CannotRun as e:
        hard_exit(3, f"{PREFIX}: cannot run here: rank {rank}: {e}")
    except Exception as e:  # noqa: BLE001 - the store went during the start barrier
        hard_exit(3, f"{PREFIX}: cannot run here: rank {rank}: start failed: {type(e).__name__}: {e}")
    signal.signal(signal.SIGTERM, lambda *_: hard_exit(1, f"{PREFIX}: rank {rank}: terminated"))
    try:
        startup = time.perf_counter() - START
        trainer.begin()
        model, losses = trainer.model, []
        with local_sgd:
            for step in range(trainer.steps):
                optimizer.zero_grad()
                loss = trainer.loss(model, step)
                trainer.straggle()  # the straggler's sleep, between forward and backward
                loss.backward()
                optimizer.step()  # LocalSGD's hook: every sync_every steps, quorum + averaging
                losses.append(loss.item())
                trainer.after_step(step + 1)
                watchdog.beat(f"step {step + 1}")
        own_seconds = time.perf_counter() - trainer.start
        store.set(f"done/{rank}", json.dumps(sent[0]))
    except Exception as e:  # noqa: BLE001
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
    syncs, due = manager.current_step(), trainer.steps // args.sync_every
    facts = {
        "library": f"torchft {version('torchft')}", "torch": torch.__version__,
        "optimizer": "torchft.local_sgd.LocalSGD over ako's SGD", "sync_every": args.sync_every,
        "settings": f"LocalSGD sync_every {args.sync_every}, replica groups of 1, Gloo, lighthouse tick {args.quorum_tick_ms} ms",
        "replica_groups": world, "replica_group_size": 1, "process_group": "torchft.ProcessGroupGloo",
        "pg_timeout": args.pg_timeout, "min_replica_size": 1, "init_sync": False, "use_async_quorum": True,
        "checkpoint_transport": "PGTransport",
        "lighthouse": {"min_replicas": 1, "quorum_tick_ms": args.quorum_tick_ms, "join_timeout_ms": args.join_timeout_ms,
                       "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "started_by": "rank 0 (torchft.coordination.LighthouseServer)"},
        "discovery": "torchft lighthouse at rank 0; its address through the job's TCPStore",
        "syncs_committed_rank0": syncs, "syncs_due": due, "batches_committed_rank0": manager.batches_committed(),
        "bytes_sent_per_worker": {str(r): json.loads(v) for r, v in sorted(done.items())},
        "bytes_counted": "2 (n-1)/n x the bytes of each tensor LocalSGD all-reduced (a ring all-reduce's share; n: the quorum's replicas)",
        "workers_finished": len(done), "workers_lost": gone, "startup_seconds": round(startup, 2),
        "rank0_steps_seconds": round(own_seconds, 3), "first_loss": round(first, 4), "last_loss": round(last, 4),
    }  # fmt: skip
    watchdog.beat("evaluating rank 0's snapshots")
    mean_sent = round(sum(sent_all) / len(sent_all)) if sent_all else None
    result = trainer.finish(ARM, mean_sent, facts=facts) if args.out else None
    code = 0
    if args.check:
        if not down:
            print(f"{PREFIX}: check failed: the loss did not go down (first {first:.4f}, last {last:.4f})")
            code = 1
        elif syncs == 0:
            print(f"{PREFIX}: check failed: no sync committed (loss {first:.4f} -> {last:.4f})")
            code = 1
        else:
            print(f"{PREFIX}: check passed: loss {first:.4f} -> {last:.4f} in {trainer.steps} steps on "
                  f"{world} workers, {syncs} of {due} syncs committed")  # fmt: skip
    elif result:
        end = result["records"][-1]
        print(f"{PREFIX}: {trainer.steps} steps on {world} workers in {result['train_seconds']:.1f} s, "
              f"{result['samples_per_second']:.0f} samples/s, accuracy {end['accuracy']:.4f}, "
              f"{syncs} of {due} syncs committed" + (f"; ranks {gone} did not finish" if gone else ""))  # fmt: skip
    watchdog.beat("waiting for the other workers to close")
    ENDING.set()
    with contextlib.suppress(Exception):  # the others no longer need this store nor the lighthouse
        store.set("closed/0", "1")
        wait_for(store, "closed", world, 10, gone_before=gone)
    with contextlib.suppress(Exception):
        manager.shutdown(wait=False)
    with contextlib.suppress(Exception):
        lighthouse.shutdown()
    hard_exit(code)  # torchft's threads must not hold the exit
    return code


def main() -> int:
    try:
        cli = parser()  # imports peer_common, hence torch and ako
    except Exception as e:  # noqa: BLE001
        print(f"{PREFIX}: cannot run here: import failed: {type(e).__name__}: {e}")
        return 3
    args = cli.parse_args()
    if args.check and "RANK" not in os.environ:
        try:
            importlib.import_module("torchft")  # the quick answer to "can this arm run here"
        except Exception as e:  # noqa: BLE001
            print(f"{PREFIX}: cannot run here: import failed: {type(e).__name__}: {e}")
            return 3
        return launch_check(__file__, sys.argv[1:], CHECK["workers"], 3 * args.timeout)
    fill_defaults(args)
    if not args.out and not args.check:
        print(f"{PREFIX}: --out is required (rank 0 writes the result there)")
        return 2
    return run_worker(args)


if __name__ == "__main__":
    sys.exit(main())
