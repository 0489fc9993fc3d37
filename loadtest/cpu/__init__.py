"""The CPU benchmarks: Canvas against the transformers reference (`bench`, with its measured
runs in `bench_runs`, the comparison in `bench_report`, the reference in `reference` and the
FLOP floor in `floor`), and Canvas against itself (`prefix_bench`, `hybrid_bench`,
`structured_bench`, `image_mix_bench`), one forward in fp32 and bf16 (`dtype_bench`), and
weight-only int8's projections against fp32's and bf16's (`int8_bench`).
Each is `python -m loadtest.cpu.<name>`."""
