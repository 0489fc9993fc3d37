"""Where checkpoints come from, besides a directory the user names: the built-in default model
Canvas converts offline into its cache (`default`) and the tiny random-weight presets the tests,
the benchmarks and `canvas make-tiny` build (`tiny`), and models on the Hugging Face hub, named
`org/name[@revision]` and downloaded into a cache (`hub`)."""
