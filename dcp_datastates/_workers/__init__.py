"""The package's threads: the engine's pools, one per kind of work, and a worker woken to run a
step function in the background."""
