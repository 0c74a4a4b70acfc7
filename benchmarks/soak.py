"""Soaks: long runs with repeated failures, and what they end with, against runs without any.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--seed 0] [--parts restarts,decentralised]
                                        [--strategies allreduce,bsp,ako,gossip]

restarts: `allreduce` and `bsp` (1 server) under `torchrun --max-restarts 20 --checkpoint-every
2s` for about --minutes each, a random process (worker or server) killed -9 every 30-90 s
(seeded). Each attempt resumes from the last complete checkpoint; the run must end with the
final parameters of the same run never interrupted (to 1e-6). The epochs are chosen from a
two-epoch run so that the training alone takes about --minutes; the restarts come on top.

decentralised: `ako` and `gossip` on 4 workers (`ako train`, --timeout 10): worker 2 is
SIGSTOPped for 2 x the timeout, and worker 3 killed -9, in the same run. Every live worker
must finish, the summary must say rank 2 "stopped" and rank 3 "died", and the replicas'
average must reach the accuracy of a 3-worker run (n - 1) within 1 point.

Prints one line per run and a table of the checks; exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

PYTHON = sys.executable
DATA = ["--dataset", "fashion-mnist", "--train-samples", "6000", "--test-samples", "1000", "--batch-size", "32",
        "--eval-every", "1", "--no-progress"]  # fmt: skip


def train(args: list[str], out_dir: Path, torchrun: int | None = None, restarts: int = 0, killer=None) -> dict:
    """One `ako train` (under torchrun with `torchrun` processes per node); `killer(proc)` runs
    beside it on a thread. Returns the summary, with the stderr lines and wall seconds."""
    cmd = [PYTHON, "-m", "ako", "train", *args, "--out-dir", str(out_dir)]
    if torchrun is not None:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun),
                    "--max-restarts", str(restarts)]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    thread = threading.Thread(target=killer, args=(proc,), daemon=True) if killer else None
    if thread:
        thread.start()
    out, err = proc.communicate()
    wall = time.monotonic() - start
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stderr.txt").write_text(err)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-12:])}: exit status {proc.returncode}\n{err[-2000:]}")
    (run_dir,) = [Path(line.split()[-1]) for line in out.splitlines() if line.strip().startswith("run directory")]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {**summary, "stderr": err.splitlines(), "wall": wall}


def children(proc: subprocess.Popen, prefix: str = "ako-") -> dict[str, int]:
    """The live processes below `proc` whose names start with `prefix`: {name: pid}."""
    found, todo = {}, [proc.pid]
    while todo:
        pid = todo.pop()
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for kid in map(int, kids):
            todo.append(kid)
            try:
                name = Path(f"/proc/{kid}/comm").read_text().strip()
            except OSError:
                continue
            if name.startswith(prefix):
                found[name] = kid
    return found


def random_kills(seed: int, log: list):
    """A killer: every 30-90 s (seeded), kill -9 one of the job's processes, while it runs."""
    rng = random.Random(seed)

    def kill(proc):
        while proc.poll() is None:
            deadline = time.monotonic() + rng.uniform(30, 90)
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            live = sorted(children(proc).items())
            if proc.poll() is not None or not live:
                return
            name, pid = rng.choice(live)
            try:
                os.kill(pid, signal.SIGKILL)
                log.append((round(time.monotonic(), 1), name))
            except ProcessLookupError:
                pass

    return kill


def final_params(summary: dict) -> torch.Tensor:
    """The saved model's parameters (model.pt, a state_dict), flat, as float64."""
    state = torch.load(Path(summary["run_dir"]) / "model.pt", map_location="cpu", weights_only=True)
    return torch.cat([t.flatten().double() for t in state.values()])


def restarts(strategy: str, minutes: float, seed: int, out: Path) -> dict:
    servers = ["--servers", "1"] if strategy == "bsp" else []
    procs = 3 if servers else 2
    base = ["--strategy", strategy, *servers, *DATA, "--seed", str(seed), "--checkpoint-every", "2s"]
    probe = train([*base, "--epochs", "2"], out / "probe", torchrun=procs)
    epoch_seconds = probe["wall_seconds"] / 2  # rank 0's, training and evaluation, not start-up
    epochs = max(2, math.ceil(minutes * 60 / max(epoch_seconds, 1e-3)))  # the kills' restarts come on top
    kills: list = []
    soaked = train([*base, "--epochs", str(epochs)], out / "soak", torchrun=procs, restarts=20,
                   killer=random_kills(seed, kills))  # fmt: skip
    whole = train([*base, "--epochs", str(epochs)], out / "whole", torchrun=procs)
    diff = (final_params(soaked) - final_params(whole)).abs().max().item()
    resumes = sum("resuming" in line for line in soaked["stderr"])
    print(f"{strategy}: {epochs} epochs; uninterrupted {whole['wall']:.0f} s, soak {soaked['wall']:.0f} s with "
          f"{len(kills)} kills ({', '.join(name for _, name in kills)}), {resumes} resumes; "
          f"max |params - uninterrupted| = {diff:.3g}; accuracy {soaked['test_accuracy']:.4f} vs {whole['test_accuracy']:.4f}",
          flush=True)  # fmt: skip
    return {"check": f"{strategy}: soak ends with the uninterrupted run's parameters (1e-6)",
            "ok": diff <= 1e-6 and len(kills) > 0 and resumes > 0}  # fmt: skip


def decentralised(strategy: str, seed: int, out: Path, timeout: float = 10.0) -> list[dict]:
    base = ["--strategy", strategy, *DATA, "--seed", str(seed), "--epochs", "30", "--timeout", f"{timeout:g}"]
    reference = train([*base, "--workers", "3"], out / "n-1")
    events: list = []

    def stop_and_kill(proc):
        every = {f"ako-rank{r}" for r in range(4)}
        # metrics.jsonl comes only at the end (snapshots are evaluated after training): wait for the ranks
        while proc.poll() is None and not (list((out / "n").glob("*/config.toml")) and every <= set(children(proc))):
            time.sleep(0.2)
        time.sleep(8)  # training is under way
        pids = children(proc)
        os.kill(pids["ako-rank2"], signal.SIGSTOP)
        events.append("stop 2")
        time.sleep(2 * timeout)
        os.kill(pids["ako-rank2"], signal.SIGCONT)
        events.append("cont 2")
        time.sleep(5)
        if proc.poll() is None:
            os.kill(pids["ako-rank3"], signal.SIGKILL)
            events.append("kill 3")

    run = train([*base, "--workers", "4"], out / "n", killer=stop_and_kill)
    how = {loss["rank"]: loss["how"] for loss in run["lost"]}
    live = [w["rank"] for w in run["per_worker"]]
    finished = all(w["steps"] == run["iterations"] for w in run["per_worker"])
    gap = reference["average_accuracy"] - run["average_accuracy"]
    print(f"{strategy}: 4 workers ({', '.join(events)}): lost {how}, live {live} finished {finished}, "
          f"average accuracy {run['average_accuracy']:.4f} vs {reference['average_accuracy']:.4f} with 3 workers "
          f"({run['wall']:.0f} s and {reference['wall']:.0f} s)", flush=True)  # fmt: skip
    return [
        {"check": f"{strategy}: every live worker finishes", "ok": live == [0, 1] and finished},
        {"check": f"{strategy}: the summary says rank 2 stopped, rank 3 died", "ok": how == {2: "stopped", 3: "died"}},
        {"check": f"{strategy}: average within 1 point of n-1 workers' ({gap * 100:+.1f})", "ok": gap <= 0.01},
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of each restart soak (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="restarts,decentralised")
    parser.add_argument("--strategies", default="allreduce,bsp,ako,gossip", help="of each part, these only")
    parser.add_argument("--out-dir", default=None, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="ako-soak-"))
    checks = []
    if "restarts" in args.parts:
        checks += [restarts(s, args.minutes, args.seed, out / s) for s in ("allreduce", "bsp") if s in args.strategies]
    if "decentralised" in args.parts:
        checks += [c for s in ("ako", "gossip") if s in args.strategies for c in decentralised(s, args.seed, out / s)]
    print(f"\n{'check':<75} result")
    for c in checks:
        print(f"{c['check']:<75} {'pass' if c['ok'] else 'FAIL'}")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
