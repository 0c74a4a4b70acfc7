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
import importlib
import json
import multiprocessing as mp
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
from pathlib import Path

START = time.perf_counter()
ARM = "hivemind"
PREFIX = f"peer_{ARM}"
sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = {
    "target_batch_size": 10240,
    "matchmaking_time": 1.0,
    "averaging_timeout": 5.0,
}
# --check: 2 workers, 4 epochs of 6400 samples (200 steps each, 4 Hivemind epochs of 50 steps), a
# small test set and one snapshot an epoch: about 10 s of training.
CHECK = {"workers": 2, "train_samples": 6400, "epochs": 6.0, "test_samples": 1000, "eval_every": 1.0,
         "target_batch_size": 6400, "matchmaking_time": 0.5}
COMMON_DEFAULTS = dict.fromkeys(("epochs", "train_samples", "test_samples", "eval_every"))  # add_arguments'


class CannotRun(Exception):
    """The arm cannot run here (exit 3)."""


# ---- the same small helpers as peer_torchft.py ---------------------------------------------

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


# ---- the Hivemind arm ---------------------------------------------------------------------


def own_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="hivemind.Optimizer(verbose=True): log its rounds")


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
    except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
        raise CannotRun(f"import failed: {type(e).__name__}: {e}") from e
    master, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        host = own_address(master)
        store = connect_store(master, port, rank, world, args.timeout)
        heartbeat(master, port, rank, world, args.timeout)
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
    except Exception as e:  # noqa: BLE001
        raise CannotRun(f"start failed: {type(e).__name__}: {e}") from e
    return torch, hivemind, store, trainer, dht, opt, counters


def run_worker(args) -> int:
    import peer_common

    rank, world = peer_common.env_rank()
    watchdog = Watchdog(rank, args.timeout + DEAD_AFTER + 30)  # later than any of our own waits
    try:
        torch, hivemind, store, trainer, dht, opt, counters = start(args, rank, world, watchdog)
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
    except Exception as e:  # noqa: BLE001
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
    result = trainer.finish(ARM, round(sum(sent) / len(sent)) if sent else None, facts=facts) if args.out else None
    code = 0
    if args.check:
        if not down:
            print(f"{PREFIX}: check failed: the loss did not go down (first {first:.4f}, last {last:.4f})")
            code = 1
        elif rounds == 0:
            print(f"{PREFIX}: check failed: no averaging round completed (loss {first:.4f} -> {last:.4f})")
            code = 1
        else:
            print(f"{PREFIX}: check passed: loss {first:.4f} -> {last:.4f} in {trainer.steps} steps on "
                  f"{world} workers, {rounds} averaging rounds")  # fmt: skip
    elif result:
        end = result["records"][-1]
        print(f"{PREFIX}: {trainer.steps} steps on {world} workers in {result['train_seconds']:.1f} s, "
              f"{result['samples_per_second']:.0f} samples/s, accuracy {end['accuracy']:.4f}, {rounds} averaging rounds"
              + (f"; ranks {gone} did not finish" if gone else ""))  # fmt: skip
    watchdog.beat("waiting for the other workers to close")
    ENDING.set()
    with contextlib.suppress(Exception):  # the others no longer need this store (nor rank 0's DHT node)
        store.set("closed/0", "1")
        wait_for(store, "closed", world, 10, gone_before=gone)
    with contextlib.suppress(Exception):
        dht.shutdown()
    hard_exit(code)  # Hivemind's helper processes and threads must not hold the exit
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
            importlib.import_module("hivemind")  # the quick answer to "can this arm run here"
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
