"""Real processes on torch.distributed: `launcher` starts them on one machine (torchrun does
across machines), `process` is one process's run, `runtime` carries out its operations, the
`mailbox` moves its messages, `checkpoint` saves and finds checkpoints, `replicas` hands rank 0
the copies the consensus distance needs."""
