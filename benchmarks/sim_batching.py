"""Would batched replicas speed up the simulator? One step's gradients of W simulated workers,
each with its own parameters and mini-batch, computed one replica at a time (what `ako
simulate` does) and in one call (`torch.func.vmap` over `functional_call` with stacked
parameters), side by side in one process with one torch thread (as a sweep cell runs).
Prints seconds per step of all W workers, the ratio one-at-a-time / batched (above 1: batching
is faster) and the largest difference between the two gradients.

    .venv/bin/python benchmarks/sim_batching.py [--workers 64] [--batch-sizes 2,4,8,16,32] [--models mlp,cnn]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from ako.models import build_model


def one_at_a_time(model, params: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Gradients (W, numel) of each replica's mean cross-entropy, a backward per replica, as
    the simulator computes them: the module's parameters are views of the replica's flat vector."""
    tensors = list(model.parameters())
    flat, grads = torch.empty(params.shape[1]), torch.empty_like(params)
    offset = 0
    for p in tensors:  # the module's parameters and gradients alias flat buffers, as in `Replica`
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    for w in range(params.shape[0]):
        flat.copy_(params[w])
        for p in tensors:
            p.grad = None
        F.cross_entropy(model(xs[w]), ys[w]).backward()
        torch.cat([p.grad.reshape(-1) for p in tensors], out=grads[w])
    return grads


def batched(model, params: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """The same gradients in one vmapped call over the stacked parameters."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    views, offset = {}, 0
    for name, shape in zip(names, shapes):
        views[name] = params[:, offset : offset + shape.numel()].view(params.shape[0], *shape)
        offset += shape.numel()

    def loss(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    out = vmap(grad(loss))(views, xs, ys)
    return torch.cat([out[n].reshape(params.shape[0], -1) for n in names], dim=1)


def seconds(fn, *args, repeats: int = 3) -> tuple[float, torch.Tensor]:
    fn(*args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--batch-sizes", default="2,4,8,16,32")
    parser.add_argument("--models", default="mlp,cnn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.workers} replicas, one torch thread; seconds per step of all replicas (median of 3)")
    print(f"{'model':<6} {'batch':>5} {'one at a time':>14} {'batched':>9} {'ratio':>7} {'max |diff|':>11}")
    for name in args.models.split(","):
        model = build_model(name, (1, 28, 28), 10)
        numel = sum(p.numel() for p in model.parameters())
        generator = torch.Generator().manual_seed(0)
        params = torch.randn(args.workers, numel, generator=generator) * 0.05
        for b in map(int, args.batch_sizes.split(",")):
            xs = torch.randn(args.workers, b, 1, 28, 28, generator=generator)
            ys = torch.randint(0, 10, (args.workers, b), generator=generator)
            single, g1 = seconds(one_at_a_time, model, params, xs, ys)
            together, g2 = seconds(batched, model, params, xs, ys)
            print(f"{name:<6} {b:>5} {single:>13.3f}s {together:>8.3f}s {single / together:>6.2f}x "
                  f"{(g1 - g2).abs().max().item():>11.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
