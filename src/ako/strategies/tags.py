"""Every message tag, named once. Strategies' messages have tags >= 0 and count as training
traffic; the runtimes' own messages (stop, reports, snapshots, checkpoints) have tags < 0."""

# strategies: one strategy runs at a time, but distinct tags keep a trace unambiguous
AKO_WINDOW = 0  # Ako: a partition's window of one step, and the final flush (aux = ako.FLUSH)
AKO_PROGRESS = 3  # Ako's ring: "I have started the all-reduce of this step" (empty), to the previous rank
AKO_REPLICA = 4  # Ako's all-to-all: a worker's replica after the flush, averaged by every survivor (after a loss)
AKO_LOSS = 5  # Ako's all-to-all, after the flush: "I lost a peer before its flush came" (one byte, 0 or 1)
GOSSIP_PUSH = 1  # gossip push-sum: half of a worker's weighted parameters
GOSSIP_DONE = 2  # gossip: the end-of-training handshake
PS_PUSH = 10  # parameter servers: a worker's gradient (or update) shard
PS_REPLY = 11  # parameter servers: a server's reply to a push: its parameter shard (easgd: the elastic difference)
ABSP_STOP = 12  # A-BSP: "stop after your current micro-batch"
EASGD_CENTRE = 13  # EASGD: the centre variable, to rank 0 at the end
MEAN_SCATTER = 14  # a compressed mean (strategies/mean.py): a worker's chunk, to the chunk's owner
MEAN_GATHER = 15  # a compressed mean: the owner's mean of its chunk, to every peer

# the runtimes' own
RUN_STOP = -1  # rank 0 reached the target accuracy: every worker stops
CLOSE = -2  # the mailbox's goodbye
PROBE = -3  # the bandwidth probe
REPORT = -4  # a rank's report to rank 0 at the end
FINAL = -5  # a worker's final replica, to rank 0
SNAPSHOT_REQUEST = -6  # `ops.Pull`: "send me your published snapshot"
SNAPSHOT = -7  # the answer to it
REPLICA = -8  # a replica's copy at an evaluation point, for the consensus distance
CHECKPOINT = -9  # rank 0's call for a checkpoint at a step
DROPPED = -10  # "rank `aux` was silent for the timeout: we go on without it" (to it, and to every other peer)
PING = -11  # "show me you are alive": a peer that has not been heard from since a send to it
PONG = -12  # the answer to PING, from the receive thread that read it


def name(tag: int) -> str:
    """The name of `tag` for messages ("SNAPSHOT"), or its number when it has none."""
    return next((k for k, v in globals().items() if k.isupper() and v == tag), str(tag))
