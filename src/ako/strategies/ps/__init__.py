"""The parameter-server family: servers own shards of the flat parameters (`base`), workers
push and pull. `bsp`, `ssp` (also `asp`), `absp` and `easgd` are its strategies."""
