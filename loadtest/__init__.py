"""Load generation, benchmarks and GPU tools for Canvas, in three parts (loadtest/README.md):

- `loadtest.load`: the load generator, its requests, records and reports, and the servers it
  drives (in this process or as a sidecar), with soak and fuzz runs (`make soak`, `make fuzz`);
- `loadtest.cpu`: the CPU benchmarks, Canvas against the transformers reference and Canvas
  against itself (`make bench`, `bench-prefix`, `bench-hybrid`, `bench-structured`);
- `loadtest.gpu`: the GPU tools: the compile check without a GPU, the roofline and its op
  accountant, the GPU check and the GPU benchmark (`make gpu-compile`, `roofline`,
  `gpu-check`, `gpu-bench`).

`loadtest.machine` holds what they share: the machine facts a report states and the argument
parsers."""
