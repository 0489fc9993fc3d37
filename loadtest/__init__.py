"""Load generator, benchmark harness, reports and plots (`python -m loadtest.loadgen`,
`python -m loadtest.bench`). See loadtest/README.md."""
