"""A loop with gradient accumulation (2 micro-batches a step), for tests/test_loop.py:
`loop_accumulate.py OUT MODE`, MODE no_sync (the first micro-batch's backward under
model.no_sync()), plain (both backwards reduce), or amp (bf16 autocast, a GradScaler, clipping)."""

import contextlib
import os
import sys

import torch
import torch.nn.functional as F

import ako
import loop_script as ls

out, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = ls.mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=ls.LR, momentum=ls.MOMENTUM, nesterov=True, weight_decay=ls.WEIGHT_DECAY)
loader = torch.utils.data.DataLoader(ls.digits_like(), batch_size=2 * ls.BATCH)
model, optimizer, loader = ako.wrap(model, optimizer, loader, strategy="allreduce")
scaler = torch.amp.GradScaler("cpu", enabled=mode == "amp")
for step, (x, y) in zip(range(3), loader):
    optimizer.zero_grad()
    for k, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
        with model.no_sync() if mode == "no_sync" and k == 0 else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "amp"):
                loss = F.cross_entropy(model(xs), ys) / 2
            scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
    scaler.step(optimizer)
    scaler.update()
model = ako.finish(model)
torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), os.path.join(out, f"rank{os.environ['RANK']}.pt"))
