"""What the launcher's fork server loads once, before it forks each launched process
(`launcher.launch_function`). Only the fork server imports this module.

A spawned process imports torch and torch._dynamo (which torch.optim's first step loads) by
itself, 2.8 s of CPU each here, before it can join the job; forked from a server that has
them loaded, it starts in milliseconds.

The server ignores Ctrl-C (as multiprocessing's does) and SIGTERM, from before it loads
anything, and each process it forks starts so (`launcher._child` then sets its own
handlers): a signal to the whole process group (`timeout`, a batch scheduler) is the
launcher's to act on, and the launcher learns how each process ended from the server. The
server ends when its launcher and the processes it forked have.
"""

import atexit
import os
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
# The server's own end, after its launcher's: at once, not after a teardown of torch (1.2 s),
# during which it would keep the command's stdout open (`ako train | tee log` waits for that).
atexit.register(os._exit, 0)

import torch._dynamo  # noqa: E402, F401 -- what torch.optim's first step imports
import ako.runtime.distributed.launcher  # noqa: E402, F401 -- the runtime, the strategies, the models, the data
