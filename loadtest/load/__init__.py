"""Load generation and its reports: one timed request (`client`), the load generator
(`loadgen`, `python -m loadtest.load.loadgen`), per-request records and summaries (`stats`), the
engine's overhead from /metrics (`metrics`), prompt sets (`prompts`), reports and plots
(`report`), a Canvas server in this process (`inprocess`) or in its own (`sidecar`), and the
hostile-traffic runs (`fuzz`, `soak`)."""
