"""What the launcher's fork server loads once, before it forks each launched process
(`launcher.launch_function`). Only the fork server imports this module.

A spawned process imports torch and torch._dynamo (which torch.optim's first step loads) by
itself, 2.8 s of CPU each here, before it can join the job; forked from a server that has
them loaded, it starts in milliseconds.

The server ignores Ctrl-C (as multiprocessing's does) and SIGTERM, from before it loads
anything, and each process it forks starts so (`launcher._child` then sets its own handlers): a SIGTERM to the whole process group
(`timeout`, a batch scheduler) must not end the server, whose end kills every launched process
(their parent-death signal) before rank 0 has logged its metrics. The server ends when its
launcher does."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)

import torch._dynamo  # noqa: E402, F401 -- what torch.optim's first step imports
import ako.runtime.distributed.launcher  # noqa: E402, F401 -- the runtime, the strategies, the models, the data
