"""The runtime-neutral core of a run: the job (`job`), a worker's place in its data and when it
stops (`worker`), the consensus distance (`consensus`) and the run's outcome (`outcome`).
Both runtimes (`ako.runtime.distributed`, `ako.runtime.simulated`) build on it."""
