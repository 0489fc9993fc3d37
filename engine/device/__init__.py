"""Fitting the engine onto its device."""
