"""What serving accepts of tensor parallelism today: `--tensor-parallel-size 1`. The parallel
model runs (`engine.parallel.loader.load_sharded`), led by rank 0 (`engine.parallel.step`),
but the serving path over several ranks (`canvas serve` starting the ranks, the runner driving
a `Leader`, the sampler sharded over the vocabulary, a dead rank taking the server down) is not
built: docs/parallelism.md says what remains. Refused with a message rather than half served."""

from __future__ import annotations

PARALLELISM_DOC = "docs/parallelism.md"


def check_tensor_parallel(size: int, exact: bool) -> None:
    """ValueError, naming the flag, unless `size` is what serving runs: 1. `exact` with more
    than one rank is refused on its own grounds (a sum split over ranks reorders the reductions
    whose bits the reference's tokens depend on)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if size == 1:
        return
    if exact:
        raise ValueError(
            f"--exact runs on one device only: --tensor-parallel-size {size} splits the sums "
            "the reference's exact tokens depend on; drop --exact or use --tensor-parallel-size 1"
        )
    raise ValueError(
        f"--tensor-parallel-size {size}: serving over several ranks is not built yet (the "
        f"parallel model is, without the multi-rank step loop; see {PARALLELISM_DOC}); use 1, "
        "or more replicas behind the gateway"
    )
