"""Tensor and expert parallelism over `torch.distributed` (gloo on CPU, NCCL on CUDA): the
process group (`world`), which part of each parameter a rank holds (`plan`), the in-place
rewrite into a rank's shard (`layers`), the loader that reads only those slices (`loader`),
rank 0 leading the others through a step's model calls (`step`), the communication's
accounting (`roofline`), and serving over ranks: the processes (`ranks`), what serving accepts
and how rank 0 starts (`serving`). docs/parallelism.md has the design."""
