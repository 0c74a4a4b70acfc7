# A nanoGPT-style training loop (after Karpathy's nanoGPT train.py: random windows of a token
# stream, AdamW with and without weight decay, warm-up and cosine decay of the learning rate,
# gradient accumulation, bf16 autocast and a GradScaler, clipping, periodic evaluation, a
# checkpoint) on ako's GPT and Debian's fortunes. original.py is the loop alone, train.py the
# same with ako's three lines (`diff original.py train.py`).
import argparse
import math
import os

import torch
import torch.nn.functional as F

from ako.data.text import load_text
from ako.models import GPT

parser = argparse.ArgumentParser(description="a nanoGPT-style loop on the fortunes")
parser.add_argument("--max-iters", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--grad-accum", type=int, default=2)
parser.add_argument("--context", type=int, default=64)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup", type=int, default=20)
parser.add_argument("--eval-interval", type=int, default=50)
parser.add_argument("--eval-iters", type=int, default=10)
parser.add_argument("--out", default="ckpt.pt")
args = parser.parse_args()

rank = int(os.environ.get("RANK", 0))
torch.manual_seed(1337 + rank)  # each process draws its own batches (nanoGPT's seed_offset)
data = load_text("fortunes", args.context)
train_tokens, val_tokens = data.train.tokens, data.test.tokens


def get_batch(split):
    tokens = train_tokens if split == "train" else val_tokens
    ix = torch.randint(len(tokens) - args.context - 1, (args.batch_size,))
    x = torch.stack([tokens[i : i + args.context] for i in ix])
    y = torch.stack([tokens[i + 1 : i + 1 + args.context] for i in ix])
    return x, y


def get_lr(it):
    if it < args.warmup:
        return args.lr * (it + 1) / (args.warmup + 1)
    progress = (it - args.warmup) / max(1, args.max_iters - args.warmup)
    return args.lr * 0.1 + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.lr * 0.1)


@torch.no_grad()
def estimate_loss(model):
    model.eval()
    out = {}
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            x, y = get_batch(split)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses[k] = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
        out[split] = losses.mean().item()
    model.train()
    return out


model = GPT(len(data.vocabulary.chars), args.context, layers=args.layers, heads=4, width=args.width)
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95))
scaler = torch.amp.GradScaler("cpu", enabled=False)  # bf16 needs no loss scale; fp16 on a GPU would
x, y = get_batch("train")
for it in range(args.max_iters):
    for group in optimizer.param_groups:
        group["lr"] = get_lr(it)
    if it % args.eval_interval == 0 or it == args.max_iters - 1:
        losses = estimate_loss(model)
        print(f"rank {rank} step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
    for micro_step in range(args.grad_accum):
        model.require_backward_grad_sync = micro_step == args.grad_accum - 1  # as nanoGPT does under DDP
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / args.grad_accum
        x, y = get_batch("train")
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
if rank == 0:
    torch.save({"model": model.state_dict(), "vocabulary": data.vocabulary.chars}, args.out)
