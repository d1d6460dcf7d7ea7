"""Simulation: a step cost model, a simulated executor, and a discrete-event fleet simulator."""
