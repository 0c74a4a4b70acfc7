"""`ako simulate`: a job on a simulated cluster, from the data and replicas to the summary.

Every rank's program runs on one `SimulatedRuntime`; the run directory, the summary and its
evaluations are the distributed runtime's (`ako.run.outcome`), with time in virtual seconds,
plus the simulator's own figures (`simulation` in the summary).
"""

from __future__ import annotations

import math
import time

import simpy
import torch

from ako.metrics import duration, per_worker
from ako.run.job import Data, Job
from ako.run.outcome import WorkerResult, final_summary, open_log, open_run_dir, publish
from ako.run.worker import WorkerState
from ako.runtime.simulated.costs import Costs
from ako.runtime.simulated.progress import Progress
from ako.runtime.simulated.replicas import SharedReplicas
from ako.runtime.simulated.runtime import SimulatedRuntime
from ako.strategies import ServerContext, WorkerContext


def simulate_job(job: Job, costs: Costs, data: Data | None = None) -> tuple[dict, list[WorkerResult]]:
    """Run `job` on a simulated cluster of `job.config.workers` workers (and `servers`), costed
    by `costs`, on `data` (default: `job.load_data()`; `job.check()` has loaded it already). Writes the run directory and prints the summary as `ako train` does, with time
    in virtual seconds, plus the simulator's own figures (`simulation` in the summary).
    Returns (summary, one WorkerResult per worker, by rank). Raises ConfigError or DataError for bad input and RuntimeError when the strategy deadlocks."""
    started = time.perf_counter()
    data = job.load_data() if data is None else data
    job = job.resolved(data)
    config, strategy = job.config, job.strategy
    n, world = config.workers, config.workers + (config.servers or 0)
    cpu = torch.device("cpu")
    replicas = [job.build_replica(data, cpu) for _ in range(world)]
    job.validate(data, replicas[0])
    env = simpy.Environment()
    threads = torch.get_num_threads()
    runtime = SimulatedRuntime(env, costs, world, n, config.step_samples, threads)
    # The parallel work runs on the gradients' threads, one torch thread each: the gradients,
    # and rank 0's test batches. Here, between events, torch gets one thread: its threads wait
    # on each other at every operation, which made a 64-worker run 3.6x to 4.4x slower with a
    # busy process beside it (benchmarks/sim_scale.py); one thread costs 10-15% on idle cores.
    torch.set_num_threads(1)
    try:
        run_dir = open_run_dir(config, strategy.name, data)
        _start(runtime, job, data, replicas, run_dir)
        try:
            runtime.run()
        except (Exception, KeyboardInterrupt) as stopped:  # as a distributed run does: the metrics up to the failure
            if runtime.nodes[0].state.evaluator is not None:
                runtime.nodes[0].state.keep_metrics()
            if isinstance(stopped, KeyboardInterrupt):
                stopped.run_dir = str(run_dir)  # for the line that ends the command
            raise
        finally:
            runtime.progress.close()
        end = env.now
        reports = [runtime.node_report(rank, end) for rank in range(world)]
        facts = runtime.nodes[0].facts
        finals = [r.params for r in replicas[:n]] if strategy.replicas_differ else []
        finishing = time.perf_counter()
        summary, model, model_dict = final_summary(job, data, runtime.nodes[0].state, reports, finals, facts, [], run_dir)
        finishing = time.perf_counter() - finishing  # the evaluations left for after training, mostly
    finally:
        runtime.gradients.close()
        torch.set_num_threads(threads)
    summary["simulation"] = _simulation_facts(runtime, costs, reports, end, time.perf_counter() - started, finishing)
    publish(run_dir, summary, format_simulation(summary), model=model_dict, log=runtime.nodes[0].state.evaluator.log,
            retry_for=job.config.timeout)
    workers = [WorkerResult(r, replicas[r].params.clone(), runtime.nodes[r].facts) for r in range(n)]
    workers[0].summary, workers[0].model = summary, model
    return summary, workers


def _start(runtime: SimulatedRuntime, job: Job, data: Data, replicas: list, run_dir) -> None:
    """Start every rank's program on `runtime` (workers first, then servers) and its progress
    bar; rank 0 evaluates its test batches on the gradients' threads."""
    config, strategy = job.config, job.strategy
    n, world = config.workers, len(replicas)
    servers = list(range(n, world))
    copies: dict = {}  # the replicas' copies at evaluation points, for the consensus distance
    for rank in range(world):
        node, replica = runtime.nodes[rank], replicas[rank]
        if rank < n:
            log = open_log(run_dir, config) if rank == 0 else None
            node.state = WorkerState(
                config=config, rank=rank, world_size=n, replica=replica, train_set=data.train, test_set=data.test,
                clock=node.clock, traffic=lambda r=rank: runtime.traffic(r), on_target=lambda r=rank: runtime.request_stop(r),
                log=log, consensus=SharedReplicas(copies, rank, n) if strategy.replicas_differ else None,
            )  # fmt: skip
            runtime.start(rank, strategy.worker, WorkerContext(rank, n, replica, config, node.state.should_stop, servers, plan_done=node.state.plan_done))
        else:
            runtime.start(rank, strategy.server, ServerContext(rank, rank - n, servers, list(range(n)), replica, config))
    rank0 = runtime.nodes[0].state
    rank0.replica.map_batches = runtime.gradients.map
    runtime.progress = Progress(runtime.env, rank0.planned_steps * n, config.progress,
                                lambda: rank0.evaluator.log.records[-1] if rank0.evaluator.log.records else None)  # fmt: skip
    rank0.evaluation_bar = not runtime.progress.bar.disable  # and, after it, one over the evaluations left


def _simulation_facts(runtime: SimulatedRuntime, costs: Costs, reports: list[dict], end: float, real: float,
                      finishing: float) -> dict:  # fmt: skip
    """The simulator's own figures: cost constants, virtual and real seconds, where the real
    time went (`finishing`: the real seconds of the summary after training, counted as
    evaluation: the evaluations left until then, the consensus of the final replicas, model.pt),
    and per-role means of the time accounts."""
    evaluating = runtime.nodes[0].clock.paused_real + finishing
    workers = [r for r in reports if r["role"] == "worker"]

    def mean(key):
        return round(sum(w[key] for w in workers) / len(workers), 6)

    return {
        "seconds_per_sample": costs.seconds_per_sample,
        "shared_host_seconds_per_sample": list(costs.shared),
        "bandwidth_bytes_per_second": None if math.isinf(costs.bandwidth) else costs.bandwidth,
        "latency_seconds": costs.latency,
        "virtual_seconds": end,  # when the last program ended
        "rank0_seconds": runtime.nodes[0].clock.now(),  # train_seconds, unrounded
        "real_seconds": round(real, 3),
        "forward_backward_seconds": round(runtime.forward_backward, 3),
        "evaluation_seconds": round(evaluating, 3),
        "not_forward_backward_share": round(1 - runtime.forward_backward / max(real, 1e-9), 4),
        "worker_compute_seconds_mean": mean("compute_seconds"),
        "worker_idle_seconds_mean": mean("idle_seconds"),
        "worker_communication_seconds_mean": mean("communication_seconds"),
        "servers": [
            {k: r[k] for k in ("rank", "downlink_utilisation", "uplink_utilisation")} for r in reports if r["role"] == "server"
        ],
    }


def _compute(s: dict) -> str:
    shared = s["shared_host_seconds_per_sample"]
    if not shared:
        return f"{s['seconds_per_sample'] * 1e3:.4g} ms/sample"
    return "one shared host, " + "/".join(f"{t * 1e3:.3g}" for t in shared) + f" ms/sample with 1..{len(shared)} computing"


def format_simulation(summary: dict) -> str:
    """The simulator's lines printed after the run `summary` (its `simulation` figures, and
    each worker's time accounts)."""
    s = summary["simulation"]
    bandwidth = "free" if s["bandwidth_bytes_per_second"] is None else f"{s['bandwidth_bytes_per_second'] * 8 / 1e9:g} Gbit/s"
    return "\n".join([
        f"  simulated        {duration(s['virtual_seconds'])} virtual s in {s['real_seconds']:.1f} real s "
        f"({s['forward_backward_seconds']:.1f} s forward/backward, {s['evaluation_seconds']:.1f} s evaluating, "
        f"{s['not_forward_backward_share']:.0%} not forward/backward)",
        f"  cost model       {_compute(s)}, links {bandwidth}, latency {s['latency_seconds'] * 1e6:g} us",
        "  worker time      virtual s of " + "; ".join(f"{what} {per_worker(summary, f'{what}_seconds', duration)}"
                                                     for what in ("compute", "idle", "communication")),
    ] + [
        f"  server rank {r['rank']:<4} NIC utilisation: downlink {r['downlink_utilisation']:.0%}, uplink {r['uplink_utilisation']:.0%}"
        for r in s["servers"]
    ])  # fmt: skip
