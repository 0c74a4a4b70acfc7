"""Would batched replicas speed up the simulator? One step's gradients of W simulated workers,
each with its own parameters and mini-batch, computed one replica at a time (what `ako
simulate` does) and in one call three ways: `torch.func.vmap` over `functional_call` with
stacked parameters; a layer-by-layer form (the replicas' convolutions as one grouped
convolution in the channels-last layout, their linear layers as one batched matrix product, one
autograd graph); and an exact form (bit for bit the one-at-a-time gradients: per-replica
convolution kernels, everything else once over all replicas, no autograd graph), side by side
in one process with one torch thread (as a sweep cell runs).
Prints seconds per step of all W workers, the ratio one-at-a-time / batched (above 1: batching
is faster), the largest difference of vmap's and the layer-by-layer gradients from the
one-at-a-time ones, and whether the exact form's are equal to them bit for bit.

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


def layerwise(model, params: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """The same gradients with the W replicas laid side by side in each layer: a convolution's
    activations as (B, W x channels, H, W) and one grouped convolution (groups = W), a linear
    layer's as (W, B, features) and one batched matrix product. Only Conv2d, Linear, ReLU,
    MaxPool2d and Flatten (the built-in cnn and mlp)."""
    w, b = xs.shape[:2]
    layers = [m for m in model.modules() if not isinstance(m, torch.nn.Sequential)]
    leaves, offset = [], 0
    for p in model.parameters():  # each parameter stacked over the replicas, in the shape its layer takes
        stacked = params[:, offset : offset + p.numel()].reshape(w * p.shape[0], *p.shape[1:]) if p.dim() == 4 else None
        if stacked is None:
            stacked = params[:, offset : offset + p.numel()].reshape(w, *p.shape)
            stacked = stacked.reshape(-1) if p.dim() == 1 and leaves and leaves[-1].dim() == 4 else stacked
        leaves.append(stacked.contiguous().requires_grad_())
        offset += p.numel()
    it = iter(leaves)
    h = xs.transpose(0, 1).reshape(b, -1, *xs.shape[3:])  # (B, W x C, H, W)
    for m in layers:
        if isinstance(m, torch.nn.Conv2d):
            h = F.conv2d(h.contiguous(memory_format=torch.channels_last), next(it), next(it), m.stride, m.padding,
                         m.dilation, w)  # fmt: skip
        elif isinstance(m, torch.nn.ReLU):
            h = F.relu(h)
        elif isinstance(m, torch.nn.MaxPool2d):
            h = F.max_pool2d(h, m.kernel_size, m.stride)
        elif isinstance(m, torch.nn.Flatten):
            h = h.contiguous().view(b, w, -1).transpose(0, 1)  # (W, B, features)
        elif isinstance(m, torch.nn.Linear):
            weight, bias = next(it), next(it)
            h = torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))
    F.cross_entropy(h.reshape(w * b, -1), ys.reshape(-1), reduction="none").view(w, b).mean(1).sum().backward()
    return torch.cat([leaf.grad.reshape(w, -1) for leaf in leaves], dim=1)


def exact(model, params: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """The same gradients bit for bit, batched where batching cannot change a bit: each
    replica's convolutions are its own calls of the kernels autograd calls (forward and
    `convolution_backward`, in the module's layout), while ReLU, max pooling (exact: a max and a
    scatter), the linear layers (`baddbmm`/`bmm`, whose slices are the per-replica products here)
    and the loss's gradient run once over all W replicas, with no autograd graph but the loss's.
    Only Conv2d, Linear, ReLU, MaxPool2d and Flatten (the built-in cnn and mlp)."""
    w, b = xs.shape[:2]
    layers = [m for m in model.modules() if not isinstance(m, torch.nn.Sequential)]
    shapes = [p.shape for p in model.parameters()]
    bounds = [0]
    for shape in shapes:
        bounds.append(bounds[-1] + shape.numel())
    grads = torch.empty_like(params)
    weights = [params[:, lo:hi].view(w, *shape) for lo, hi, shape in zip(bounds, bounds[1:], shapes)]
    out = [grads[:, lo:hi].view(w, *shape) for lo, hi, shape in zip(bounds, bounds[1:], shapes)]
    cl, tape, k, h = torch.channels_last, [], 0, xs.reshape(w * b, *xs.shape[2:])
    for m in layers:  # forward, keeping what each backward needs
        if isinstance(m, torch.nn.Conv2d):
            tape.append((m, h, k))
            h = torch.cat([F.conv2d(h[r * b : (r + 1) * b], weights[k][r], weights[k + 1][r], m.stride, m.padding,
                                    m.dilation) for r in range(w)])  # fmt: skip
            k += 2
        elif isinstance(m, torch.nn.ReLU):
            h = torch.relu(h)
            tape.append((m, h, None))
        elif isinstance(m, torch.nn.MaxPool2d):
            h = h.contiguous(memory_format=cl)
            pooled, where = torch.ops.aten.max_pool2d_with_indices(h, [m.kernel_size] * 2, [m.stride] * 2)
            tape.append((m, h, where))
            h = pooled.contiguous()
        elif isinstance(m, torch.nn.Flatten):
            tape.append((m, h.shape, None))
            h = h.reshape(w, b, -1)
        elif isinstance(m, torch.nn.Linear):
            tape.append((m, h, k))
            h = torch.baddbmm(weights[k + 1].unsqueeze(1), h, weights[k].transpose(1, 2))
            k += 2
    logits = h.detach().requires_grad_()
    (g,) = torch.autograd.grad(sum(F.cross_entropy(logits[r], ys[r]) for r in range(w)), logits)
    for m, saved, k in reversed(tape):  # backward
        if isinstance(m, torch.nn.Linear):
            out[k].copy_(torch.bmm(g.transpose(1, 2), saved))
            out[k + 1].copy_(g.sum(1))
            g = torch.bmm(g, weights[k])
        elif isinstance(m, torch.nn.Flatten):
            g = g.reshape(saved)
        elif isinstance(m, torch.nn.MaxPool2d):
            g = torch.ops.aten.max_pool2d_with_indices_backward(g.contiguous(memory_format=cl), saved, [m.kernel_size] * 2,
                                                                [m.stride] * 2, [0, 0], [1, 1], False, k).contiguous()  # fmt: skip
        elif isinstance(m, torch.nn.ReLU):
            g = torch.ops.aten.threshold_backward(g, saved, 0)
        elif isinstance(m, torch.nn.Conv2d):
            first = saved.data_ptr() == xs.data_ptr()  # the input needs no gradient
            inputs = []
            for r in range(w):
                gi, gw, gb = torch.ops.aten.convolution_backward(
                    g[r * b : (r + 1) * b], saved[r * b : (r + 1) * b], weights[k][r], [m.out_channels], m.stride,
                    m.padding, m.dilation, False, [0, 0], 1, [not first, True, True])  # fmt: skip
                out[k][r].copy_(gw)
                out[k + 1][r].copy_(gb)
                inputs.append(gi)
            g = None if first else torch.cat(inputs)
    return grads


def seconds(fn, *args, repeats: int = 3) -> tuple[float, torch.Tensor]:
    fn(*args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], result


def _count(most: int):
    def parse(text: str) -> int:
        if not text.isdigit() or not 1 <= int(text) <= most:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number from 1 to {most}")
        return int(text)

    return parse


def _counts(most: int):
    return lambda text: [_count(most)(part) for part in text.split(",")]


def _models(text: str) -> list[str]:
    names = text.split(",")
    if not all(name in ("mlp", "cnn") for name in names):  # layerwise knows Conv2d, Linear, ReLU, MaxPool2d, Flatten
        raise argparse.ArgumentTypeError(f"{text!r}: must be mlp, cnn or both, comma-separated")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=_count(4096), default=64, help="replicas (1 to 4096)")
    parser.add_argument("--batch-sizes", type=_counts(4096), default="2,4,8,16,32", help="comma-separated, each 1 to 4096")
    parser.add_argument("--models", type=_models, default="mlp,cnn", help="comma-separated: mlp, cnn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.workers} replicas, one torch thread; seconds per step of all replicas (median of 3)")
    print(f"{'model':<6} {'batch':>5} {'one at a time':>14} {'vmap':>9} {'ratio':>7} {'layerwise':>10} {'ratio':>7} "
          f"{'max |diff|':>11} {'exact':>8} {'ratio':>7}  exact bit for bit")  # fmt: skip
    for name in args.models:
        model = build_model(name, (1, 28, 28), 10)
        numel = sum(p.numel() for p in model.parameters())
        generator = torch.Generator().manual_seed(0)
        params = torch.randn(args.workers, numel, generator=generator) * 0.05
        for b in args.batch_sizes:
            xs = torch.randn(args.workers, b, 1, 28, 28, generator=generator)
            ys = torch.randint(0, 10, (args.workers, b), generator=generator)
            single, g1 = seconds(one_at_a_time, model, params, xs, ys)
            together, g2 = seconds(batched, model, params, xs, ys)
            layered, g3 = seconds(layerwise, model, params, xs, ys)
            same, g4 = seconds(exact, model, params, xs, ys)
            diff = max((g1 - g2).abs().max().item(), (g1 - g3).abs().max().item())
            print(f"{name:<6} {b:>5} {single:>13.3f}s {together:>8.3f}s {single / together:>6.2f}x {layered:>9.3f}s "
                  f"{single / layered:>6.2f}x {diff:>11.2e} {same:>7.3f}s {single / same:>6.2f}x  {torch.equal(g1, g4)}")  # fmt: skip


if __name__ == "__main__":
    main()
