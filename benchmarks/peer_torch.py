"""The torch-only peer arms of `benchmarks/peers.py`, each as PyTorch's documentation shows it,
run by torchrun (one process per worker, Gloo):

- `ddp`: `DistributedDataParallel` with its defaults (its reducer all-reduces gradient buckets
  as backward produces them; this cnn's 0.83 MB gradient fits DDP's first, 1 MiB bucket).
- `powersgd-r1`, `powersgd-r4`: DDP with `powerSGD_hook` at matrix approximation rank 1 or 4,
  with error feedback and warm start (the hook's defaults), after `start_powerSGD_iter` steps
  of plain all-reduce: 10% of the run, as the hook's documentation advises (its default, 1000,
  is more than this whole run).
- `post-local-sgd`: DDP with `post_localSGD_hook` and `PostLocalSGDOptimizer` over a
  `PeriodicModelAverager`: all-reduce SGD for the first 10% of the run, then local SGD with the
  replicas' parameters averaged every `--period` steps (4; Lin et al., "Don't use large
  mini-batches, use local SGD", ICLR 2020). On the CPU the hook needs an explicit subgroup:
  each worker is its own, so between averages it trains alone.

    torchrun --standalone --nproc-per-node 4 benchmarks/peer_torch.py --arm ddp --out ddp.json

Bytes sent are counted as ako counts its collectives: a ring all-reduce of b bytes over n
workers sends 2 (n - 1) / n x b per worker; DDP's own buckets from their size, the hooks'
all-reduces by wrapping `torch.distributed.all_reduce`. `--check` exits 1 unless the loss went down
(run it with few `--epochs` or `--train-samples`).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
from peer_common import Trainer, add_arguments, env_rank  # noqa: E402

ARMS = ("ddp", "powersgd-r1", "powersgd-r4", "post-local-sgd")


class Counted:
    """`torch.distributed.all_reduce`, counting the ring bytes each call sends per worker."""

    def __init__(self):
        self.bytes, self.inner = 0, dist.all_reduce

    def __call__(self, tensor, *args, group=None, **kwargs):
        n = dist.get_world_size(group)
        self.bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
        return self.inner(tensor, *args, group=group, **kwargs)


def build(arm: str, trainer: Trainer, period: int):
    """(the DDP model, its optimizer, a function: bytes the reducer itself sent per step)."""
    warmup = warmup_steps(trainer)
    model = DistributedDataParallel(trainer.model)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n = trainer.world
    reducer_bytes = 2 * (n - 1) * grad_bytes // n
    if arm == "ddp":
        return model, trainer.optimizer(model.parameters()), lambda step: reducer_bytes
    if arm.startswith("powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=int(arm[-1]),
                                       start_powerSGD_iter=warmup)  # fmt: skip
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return model, trainer.optimizer(model.parameters()), lambda step: 0  # the hook all-reduces
    with warnings.catch_warnings():  # torch.distributed.optim imports torch.jit.script, deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer
    subgroup, _ = dist.new_subgroups(group_size=1)
    state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=warmup)
    model.register_comm_hook(state, post_localSGD_hook)
    optimizer = PostLocalSGDOptimizer(trainer.optimizer(model.parameters()),
                                      PeriodicModelAverager(period=period, warmup_steps=warmup))  # fmt: skip
    return model, optimizer, lambda step: 0  # the hook and the averager all-reduce


def train(args) -> dict | None:
    """Run `args.arm` on this process's worker (torchrun's env); rank 0 returns the result."""
    rank, world = env_rank()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    counted = Counted()
    dist.all_reduce = counted
    try:
        trainer = Trainer(args, rank, world)
        model, optimizer, reducer_bytes = build(args.arm, trainer, args.period)
        sent, losses = 0, []
        dist.barrier()
        trainer.begin()
        for step in range(trainer.steps):
            optimizer.zero_grad(set_to_none=False)
            loss = trainer.loss(model, step)
            trainer.straggle()
            loss.backward()
            optimizer.step()
            sent += reducer_bytes(step)
            losses.append(loss.item())
            trainer.after_step(step + 1)
        facts = {"first_loss": losses[0], "last_loss": sum(losses[-5:]) / len(losses[-5:]),
                 "settings": settings(args, trainer)}  # fmt: skip
        return trainer.finish(args.arm, sent + counted.bytes, facts=facts)
    finally:
        dist.all_reduce = counted.inner
        dist.destroy_process_group()


def warmup_steps(trainer: Trainer) -> int:
    """Steps of plain all-reduce before PowerSGD or local SGD: 10% of the run (PowerSGD needs 2)."""
    return max(2, trainer.steps // 10)


def settings(args, trainer: Trainer) -> str:
    warmup = warmup_steps(trainer)
    return {"ddp": "defaults", "powersgd-r1": f"rank 1, plain all-reduce for {warmup} steps",
            "powersgd-r4": f"rank 4, plain all-reduce for {warmup} steps",
            "post-local-sgd": f"average every {args.period} steps after {warmup} of all-reduce"}[args.arm]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=ARMS, required=True)
    parser.add_argument("--period", type=int, default=4, help="post-local-sgd: steps between averages")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait")
    parser.add_argument("--check", action="store_true", help="a few steps; exit 1 unless the loss went down")
    add_arguments(parser)
    args = parser.parse_args()
    result = train(args)
    if args.check and result is not None:
        went_down = result["last_loss"] < result["first_loss"]
        print(f"{args.arm}: loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}"
              f"{'' if went_down else ': did not go down'}")  # fmt: skip
        return 0 if went_down else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
