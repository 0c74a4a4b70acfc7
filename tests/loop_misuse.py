"""Scripts that use ako.wrap wrongly, for tests/test_loop.py: `python loop_misuse.py CASE`."""

import sys

import torch
from torch import nn

import ako

case = sys.argv[1]
model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
strategy = "ako"
if case == "stepped":
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
elif case == "not-held":
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
elif case == "absp":
    strategy = "absp"
elif case == "no-servers":
    strategy = "easgd"
model, optimizer = ako.wrap(model, optimizer, strategy=strategy)
print("wrapped")
