"""The two runtimes that carry out strategy programs: `distributed` (real processes on
torch.distributed) and `simulated` (a SimPy cluster in virtual time). `base` is what they
share: the loop that drives a program, and a worker's computation. Neither imports the other."""
