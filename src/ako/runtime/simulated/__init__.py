"""A simulated cluster in virtual time: `simulate` runs a job, `runtime` carries out every
rank's operations on one SimPy environment, `costs` is the cost model (compute, links,
all-reduce), `calibrate` measures its compute figure on this machine, `replicas` hands rank 0 the
copies the consensus distance needs."""
