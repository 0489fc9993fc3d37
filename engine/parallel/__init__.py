"""Tensor and expert parallelism over `torch.distributed` (gloo on CPU, NCCL on CUDA): the
process group (`world`), which part of each parameter a rank holds (`plan`), the in-place
rewrite into a rank's shard (`layers`), the loader that reads only those slices (`loader`),
and what serving accepts of it (`serving`). docs/parallelism.md has the design."""
