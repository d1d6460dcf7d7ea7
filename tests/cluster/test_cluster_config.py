"""What ``ClusterConfig`` hands each replica's workers."""

from __future__ import annotations

from kvserve.cluster.config import ClusterConfig


def test_the_workers_learn_the_resolved_max_model_len() -> None:
    # The scheduler actor resolves it from the model (a sliding window bounds it); the
    # workers check the model against it, and found only max_position_embeddings.
    config = ClusterConfig.from_kwargs("/models/m")
    assert config.worker_config(48).max_model_len == 48
    assert config.worker_config().max_model_len is None


def test_the_engine_settings_are_the_engines_and_the_cluster_adds_its_own() -> None:
    from kvserve.scheduler.engine_config import EngineConfig, ParallelConfig

    config = ClusterConfig.from_kwargs(
        "/models/m", block_size=32, num_blocks=64, parallel=ParallelConfig(num_replicas=3), routing="round_robin",
        placement_timeout_s=None,
    )
    assert config.engine == EngineConfig.from_kwargs("/models/m", block_size=32, num_blocks=64, num_replicas=3)
    assert (config.routing, config.placement_timeout_s, config.parallel.num_replicas) == ("round_robin", None, 3)
    worker = config.worker_config(128)
    assert (worker.model_dir, worker.block_size, worker.num_blocks, worker.max_model_len) == ("/models/m", 32, 64, 128)
    assert config.cache_config(64, "id").block_size == 32


def test_serve_flags_set_the_engine_settings_of_their_names_and_errors_name_the_flags(capsys) -> None:
    from kvserve.cluster.cli import build_parser, main
    from kvserve.scheduler.engine_config import EngineConfig

    parser = build_parser()
    args = parser.parse_args(["serve", "--tp", "2", "--replicas", "3", "--block-size", "32"])
    assert (args.tensor_parallel_size, args.num_replicas, args.block_size, args.num_blocks) == (2, 3, 32, None)
    flags = args.flags_of_settings
    # Every engine setting with a flag is set by its own name: nothing is mapped by hand.
    assert {name for name in EngineConfig.field_names() if name in flags} >= {
        "tensor_parallel_size", "num_replicas", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
        "max_model_len", "device", "enforce_eager",
    }
    assert (flags["tensor_parallel_size"], flags["http_port"]) == ("--tp", "--http-port")
    assert main(["serve", "--block-size", "0"]) == 2
    assert "--block-size must be an integer >= 1, got 0" in capsys.readouterr().err
