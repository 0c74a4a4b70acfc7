"""ako against what users would pick instead, side by side in one run: the same cnn on
Fashion-MNIST, per-worker batch 64, SGD at lr 0.1 (Nesterov momentum 0.9, weight decay 5e-4),
seed and shards (`peer_common.py`), the same number of workers, 2 epochs each. With `--model
gpt`: the gpt on Debian's fortunes, batch 16 a worker, AdamW at lr 3e-3 with 20 warm-up steps and
a cosine, and time to a validation loss (`--target`, default 2.3 nats per character).

Arms: ako's `ako`, `allreduce` and `gossip` (`ako train`, defaults), and the peers, each run as
its documentation shows it: PyTorch DDP plain, with PowerSGD (rank 1 and 4) and post-local SGD
(`peer_torch.py`, under torchrun), Hivemind (`peer_hivemind.py`) and torchft (`peer_torchft.py`)
in their own virtualenv (`peers_venv.sh`, made when missing). Before timing, each arm of that
virtualenv trains a few steps on 2 workers and must lower its loss; one that cannot install or run here is
left out with one line saying why.

Settings: `loopback` (the workers as processes of this machine), `netcluster` (one worker per
host of `scripts/netcluster`, links of `--rate` each way; needs root) and `straggler` (that,
with worker `--slow-rank` slowed `--factor` times: ako's `--straggler`, and for the peers a
sleep of the same size in their training loop). Prints, per arm: time to 85% test accuracy
(training seconds; snapshots every 0.1 epoch, evaluated after training) of
the replicas' average, which is the model each arm delivers when it stops (Ako's final flush
and a local-SGD arm's final average make every replica that average; the synchronous arms'
replicas are equal) and of rank 0's replica alone, accuracy after the 2 epochs, samples/s, MB sent per worker per second (payload as the arm counts it; on
netcluster also every host's eth0 bytes, headers included), and the average's time to 85% over
the best peer's. Medians over `--seeds`.

    .venv/bin/python benchmarks/peers.py [--settings loopback,netcluster,straggler] [--seeds 1]
        [--arms ako,allreduce,...] [--workers 4] [--epochs 2] [--rate 100mbit] [--factor 3]
        [--model gpt] [--target 2.3] [--sync-every 100] [--fragments 4] [--fragment-delay 1]

DiLoCo against torchft's, as the check that ours is the algorithm: the arms `diloco` and
`streaming-diloco` (`ako train`) and `torchft-diloco` and `torchft-streaming-diloco` (torchft
0.2.0's `DiLoCo`) take the same H (`--sync-every`), outer SGD (lr 0.7, Nesterov momentum 0.9),
and for streaming the same `--fragments` of whole modules (ako's `--fragment-cut modules`),
`--fragment-delay` and `--fragment-alpha` (defaults: ako's, but P = 2 on the cnn, which has
3 modules). Not among the default arms (--arms names them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer_common import average_records
from run_records import latest_run, time_to

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
AKO_ARMS = ("ako", "allreduce", "gossip", "diloco", "streaming-diloco", "ako-gradients")
# arms that are a strategy with settings: ako's windows of gradients, AdamW's default before the outer step
VARIANTS = {"ako-gradients": ("ako", ["--update", "gradients"])}
TORCH_ARMS = ("ddp", "powersgd-r1", "powersgd-r4", "post-local-sgd")
VENV_ARMS = {"hivemind": "peer_hivemind.py", "torchft": "peer_torchft.py", "torchft-diloco": "peer_torchft.py",
             "torchft-streaming-diloco": "peer_torchft.py"}  # fmt: skip
ARMS = AKO_ARMS + TORCH_ARMS + tuple(VENV_ARMS)
DEFAULT_ARMS = ("ako", "allreduce", "gossip", *TORCH_ARMS, "hivemind", "torchft")
PEERS = TORCH_ARMS + tuple(VENV_ARMS)
SYNCHRONOUS = ("ddp", "powersgd-r1", "powersgd-r4")  # their replicas are equal: the average is rank 0's
LEVEL = 0.85
NETCLUSTER = ROOT / "scripts" / "netcluster"
WORKLOADS = {  # --model -> ako train's flags, the peers' flags, the target's metric and default
    "cnn": (["--dataset", "fashion-mnist", "--batch-size", "64", "--lr", "0.1"], [], "accuracy", LEVEL),
    "gpt": (["--dataset", "fortunes", "--model", "gpt", "--batch-size", "16", "--optimizer", "adamw", "--lr", "3e-3",
             "--warmup", "20", "--lr-schedule", "cosine"], ["--model", "gpt", "--batch-size", "16", "--lr", "3e-3"],
            "loss", 2.3),
}  # fmt: skip


def diloco_flags(arm: str, args, ako: bool) -> list[str]:
    """The DiLoCo arms' settings, the same for ako's and torchft's; [] for other arms."""
    streaming = arm.endswith("streaming-diloco")
    if not arm.endswith("diloco"):
        return []
    flags = ["--sync-every", str(args.sync_every), "--outer-lr", "0.7", "--outer-momentum", "0.9"]
    if streaming:
        flags += ["--fragments", str(args.fragments), "--fragment-delay", str(args.fragment_delay),
                  "--fragment-alpha", str(args.fragment_alpha), *(["--fragment-cut", "modules"] if ako else [])]  # fmt: skip
    if not ako:
        flags += ["--algorithm", arm.removeprefix("torchft-")]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def common_args(args, seed: int, straggler: bool) -> list[str]:
    slow = ["--straggler", f"rank={args.slow_rank},factor={args.factor:g}"] if straggler else []
    return ["--epochs", str(args.epochs), "--seed", str(seed), "--eval-every", "0.1", *slow]


def command(arm: str, args, setting: str, seed: int, out: Path) -> tuple[list[str], dict]:
    """The command line that runs `arm` in `setting` (and extra environment), writing to `out`."""
    straggler = setting == "straggler"
    common = common_args(args, seed, straggler)
    n = args.workers
    ako_flags, peer_flags = WORKLOADS[args.model][:2]
    if arm in AKO_ARMS:
        strategy, settings = VARIANTS.get(arm, (arm, []))
        program = ["--strategy", strategy, *settings, "--workers", str(n), *ako_flags, *diloco_flags(arm, args, True), *common,
                   "--out-dir", str(out), "--no-progress"]  # fmt: skip
        if setting == "loopback":
            return [sys.executable, "-m", "ako", "train", *program], {}
        return [*netcluster(args), "--", *program], {}
    script = HERE / ("peer_torch.py" if arm in TORCH_ARMS else VENV_ARMS[arm])
    program = [*(["--arm", arm] if arm in TORCH_ARMS else []), *peer_flags, *diloco_flags(arm, args, False), *common,
               "--out", str(out / "result.json")]  # fmt: skip
    python = sys.executable if arm in TORCH_ARMS else str(args.peers_venv / "bin" / "python")
    if setting != "loopback":
        launcher = "torchrun" if arm in TORCH_ARMS else "env"
        return [*netcluster(args), "--script", str(script), "--launcher", launcher, "--python", python, "--", *program], {}
    if arm in TORCH_ARMS:
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), str(script), *program], {}
    return [python, str(script), *program], {"WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def netcluster(args) -> list[str]:
    return [sys.executable, str(NETCLUSTER), "--hosts", str(args.workers), "--rate", args.rate,
            "--stats", str(args.stats_file), "--timeout", str(args.timeout - 30)]  # fmt: skip (it cleans up before ours)


def launch(cmd: list[str], env: dict, workers: int, log, timeout: float) -> int:
    """Run `cmd` once, or, with RANK unset in `env` but WORLD_SIZE set, once per rank (the
    peers that find each other themselves); returns the first non-zero exit status, or 0."""
    ranks = range(workers) if env else [None]
    procs = []
    try:
        for r in ranks:
            extra = {} if r is None else {**env, "RANK": str(r), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(cmd, env={**os.environ, **extra}, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=ROOT, start_new_session=True))  # fmt: skip
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        return next((c for c in codes if c), 0)
    except subprocess.TimeoutExpired:
        return 124
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


def result_of(arm: str, out: Path, args) -> dict:
    """The arm's figures: tta (time to the target), the metric at the end ("final"), samples/s,
    payload B/s per worker, train seconds."""
    metric, target = WORKLOADS[args.model][2], args.target
    if arm in AKO_ARMS:
        s, records = latest_run(out)
        tta = time_to(records, f"test_{metric}", target)
        differ = f"average_{metric}" in records[-1]  # the replicas differ: their average is evaluated too
        return {"tta": tta, "average_tta": time_to(records, f"average_{metric}", target) if differ else tta,
                "final": s[f"test_{metric}"], "samples_per_second": s["samples_per_second"],
                "payload": s["bytes_sent_per_worker_per_second"], "train_seconds": s["train_seconds"],
                "note": s.get("partitions_reason", "")}  # fmt: skip
    r = json.loads((out / "result.json").read_text())
    records = r["records"]
    averaged = records if arm in SYNCHRONOUS else average_records(out / "result.json", records, r["workers"])
    return {"tta": time_to(records, metric, target, "seconds"),
            "average_tta": averaged and time_to(averaged, metric, target, "seconds"),
            "final": records[-1][metric], "samples_per_second": r["samples_per_second"],
            "payload": r["bytes_sent_per_worker_per_second"], "train_seconds": r["train_seconds"],
            "note": str(r.get("settings", ""))}  # fmt: skip


def run_arm(arm: str, args, setting: str, seed: int) -> dict | None:
    out = Path(tempfile.mkdtemp(prefix=f"{arm}-{setting}-{seed}-", dir=args.out_dir))
    cmd, env = command(arm, args, setting, seed, out)
    with open(out / "log.txt", "w") as log:
        code = launch(cmd, env, args.workers, log, args.timeout)
    if code:
        tail = (out / "log.txt").read_text().strip().splitlines()[-1:] or [""]
        print(f"  {arm} ({setting}, seed {seed}) failed with status {code}: {tail[0][:200]} (log {out / 'log.txt'})")
        return None
    result = result_of(arm, out, args)
    if setting != "loopback" and args.stats_file.exists():
        hosts = json.loads(args.stats_file.read_text())
        result["wire"] = statistics.mean(h["tx"]["bytes"] for h in hosts.values()) / result["train_seconds"]
    print(f"  {arm:<24} {setting:<10} seed {seed}: time to {args.target:g} {fmt(result['average_tta'])} (replicas' average), "
          f"{fmt(result['tta'])} (rank 0), {WORKLOADS[args.model][2]} {result['final']:.4f}, "
          f"{result['samples_per_second']:.0f} samples/s", flush=True)  # fmt: skip
    return result


def venv_arms_that_run(args) -> list[str]:
    """Hivemind and torchft: make their virtualenv if needed, then each must train (a few
    steps on 2 workers, loss down) before it is timed. Prints one line for each left out."""
    wanted = [a for a in args.arms if a in VENV_ARMS]
    if not wanted:
        return []
    made = subprocess.run(["bash", str(HERE / "peers_venv.sh"), str(args.peers_venv)], capture_output=True, text=True)
    if made.returncode:
        line = (made.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"  left out {', '.join(wanted)}: their virtualenv could not be made: {line}")
        return []
    running = []
    for arm in wanted:
        out = Path(tempfile.mkdtemp(prefix=f"{arm}-check-", dir=args.out_dir))
        algorithm = ["--algorithm", arm.removeprefix("torchft-")] if arm.endswith("diloco") else []
        algorithm += ["--fragments", "2", "--fragment-delay", "1"] if arm.endswith("streaming-diloco") else []  # H = 8
        cmd = [str(args.peers_venv / "bin" / "python"), str(HERE / VENV_ARMS[arm]), "--check", *algorithm,
               "--out", str(out / "result.json")]  # fmt: skip
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        with open(out / "log.txt", "w") as log:
            code = launch(cmd, env, 2, log, 300)
        lines = (out / "log.txt").read_text().strip().splitlines()
        if code:
            print(f"  left out {arm}: {lines[-1] if lines else f'status {code}'}")
        else:
            print(f"  {arm} trains: {next((line for line in reversed(lines) if 'loss' in line), 'checked')}")
            running.append(arm)
    return running


def fmt(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


def median(values: list) -> float | None:
    """Median of the values; None when one of them is None (a run that did not reach the target)."""
    return None if not values or any(v is None for v in values) else statistics.median(values)


def table(setting: str, results: dict[str, list[dict]], args) -> None:
    rows = {arm: runs for arm, runs in results.items() if runs}
    ttas = {arm: median([r["average_tta"] for r in runs]) for arm, runs in rows.items()}
    peers = [t for arm, t in ttas.items() if arm in PEERS and t is not None]
    best = min(peers) if peers else None
    best_arm = next((a for a, t in ttas.items() if a in PEERS and t == best), None) if best else None
    metric = WORKLOADS[args.model][2]
    workload = "gpt on fortunes" if args.model == "gpt" else "cnn on Fashion-MNIST"
    print(f"\n{setting}: {args.workers} workers, {workload}, {args.epochs:g} epochs, "
          f"median of {max(len(r) for r in rows.values()) if rows else 0} seed(s); best peer: {best_arm or f'none reached {args.target:g}'}")  # fmt: skip
    print(f"{'arm':<24} {f'{args.target:g}: average':>12} {'/ best peer':>11} {'rank 0':>12} {metric:>9} {'samples/s':>10} "
          f"{'MB/s sent':>10} {'wire MB/s':>10}  settings")  # fmt: skip
    for arm, runs in rows.items():
        tta = ttas[arm]
        ratio = f"{tta / best:.2f}x" if tta is not None and best else "-"
        rank0 = median([r["tta"] for r in runs])
        payload = median([r["payload"] for r in runs])
        wire = median([r.get("wire") for r in runs])
        print(f"{arm:<24} {fmt(tta):>12} {ratio:>11} {fmt(rank0):>12} {statistics.median(r['final'] for r in runs):>9.4f} "
              f"{statistics.median(r['samples_per_second'] for r in runs):>10.0f} "
              f"{'-' if payload is None else f'{payload / 1e6:.2f}':>10} {'-' if wire is None else f'{wire / 1e6:.2f}':>10}  "
              f"{runs[0]['note'][:70]}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="loopback,netcluster,straggler")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="cnn")
    parser.add_argument("--target", type=float, help="test accuracy (cnn, default 0.85) or validation loss (gpt, 2.3)")
    parser.add_argument("--sync-every", type=int, default=100, help="the DiLoCo arms' H")
    parser.add_argument("--fragments", type=int, help="the streaming arms' P (default: 4; 2 on the cnn)")
    parser.add_argument("--fragment-delay", type=int, default=1, help="the streaming arms' tau")
    parser.add_argument("--fragment-alpha", type=float, default=0.5, help="the streaming arms' alpha")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--rate", default="100mbit", help="netcluster: every link's rate, each way")
    parser.add_argument("--factor", type=float, default=3.0, help="straggler: how many times slower")
    parser.add_argument("--slow-rank", type=int, default=3, help="straggler: which worker")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one run may take")
    parser.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "peers")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    args.target = WORKLOADS[args.model][3] if args.target is None else args.target
    args.fragments = args.fragments or (4 if args.model == "gpt" else 2)
    settings = args.settings.split(",")
    bad = [a for a in args.arms if a not in ARMS] + [s for s in settings if s not in ("loopback", "netcluster", "straggler")]
    if bad:
        print(f"peers: unknown {', '.join(map(repr, bad))}; arms: {', '.join(ARMS)}; settings: loopback, netcluster, straggler")
        return 2
    if args.workers < 2 or args.seeds < 1 or args.epochs <= 0 or not 0 < args.slow_rank < args.workers or args.factor < 1:
        print("peers: --workers must be >= 2, --seeds >= 1, --epochs > 0, --slow-rank a worker other than 0, --factor >= 1")
        return 2
    if args.json and not args.json.parent.is_dir():
        print(f"peers: --json {str(args.json)!r}: its directory does not exist")
        return 2
    if any(s != "loopback" for s in settings) and os.geteuid() != 0:
        print("peers: the netcluster settings need root (network namespaces and tc)")
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.stats_file = args.out_dir / "netcluster-stats.json"
    running = set(a for a in args.arms if a not in VENV_ARMS) | set(venv_arms_that_run(args))
    arms = [a for a in args.arms if a in running]
    everything = {}
    for setting in settings:
        results = {arm: [] for arm in arms}
        for seed in range(args.seeds):
            for arm in arms:  # arms alternate within a seed, so that drift in the machine's speed spreads over them
                args.stats_file.unlink(missing_ok=True)
                result = run_arm(arm, args, setting, seed)
                if result is not None:
                    results[arm].append(result)
        everything[setting] = results
        table(setting, results, args)
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
