"""Fitting the engine onto its device: the memory plan (`engine.device.memory`)."""
