"""``kvserve experiment``: routing policies compared on one request stream, simulated or live.

The workloads (``kvserve.experiments.workloads``), the run's setup, the knee search, the
live replay on a cluster of simulated replicas, and the report (tables, CSV, plots).
"""
