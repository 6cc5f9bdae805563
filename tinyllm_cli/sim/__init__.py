"""Simulation: the real scheduler and cache bookkeeping with a measured step-cost model (see docs/simulate.md)."""
