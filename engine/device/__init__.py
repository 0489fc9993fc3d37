"""Fitting the engine onto its device: memory plan, warm-up, CUDA device and errors."""
