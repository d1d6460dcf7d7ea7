"""What ``ClusterConfig`` hands each replica's workers."""

from __future__ import annotations

from kvserve.cluster.config import ClusterConfig


def test_the_workers_learn_the_resolved_max_model_len() -> None:
    # The scheduler actor resolves it from the model (a sliding window bounds it); the
    # workers check the model against it, and found only max_position_embeddings.
    config = ClusterConfig(model_dir="/models/m")
    assert config.worker_config(48).max_model_len == 48
    assert config.worker_config().max_model_len is None
