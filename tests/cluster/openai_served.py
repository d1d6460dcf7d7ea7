"""One replica of the tiny model on the test Ray cluster, its gRPC server and its HTTP server on one event loop,
as ``kvserve serve`` runs them: the server the HTTP API's tests talk to (import its fixtures)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from kvserve.client import Client
from kvserve.cluster.config import ClusterConfig, ServerConfig
from kvserve.cluster.launcher import start_cluster
from kvserve.cluster.request_limits import RequestLimits
from kvserve.worker.tiny_model import create_tiny_model
from kvserve.worker.tokenizer import load_tokenizer
from tests.cluster.server_thread import ServerThread

BLOCK_SIZE = 8
# NOTE: 256 usable blocks (one is the null block) hold a whole context of the tiny model (2048 tokens), as a
# chat answer without max_tokens may take.
NUM_BLOCKS = 257
MAX_CONCURRENT_REQUESTS = 3
MAX_BODY_BYTES = 64 * 1024
MAX_PROMPT_BYTES = 16 * 1024
TIMEOUT_S = 60.0


@dataclass
class Served:
    base_url: str
    grpc_target: str
    model: str
    server: ServerThread
    tokenizer: object
    model_dir: Path


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = create_tiny_model(tmp_path_factory.mktemp("openai-model") / "tiny-llama", "llama", seed=0)
    handle = start_cluster(ClusterConfig.from_kwargs(str(model_dir), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS))
    server = None
    try:
        config = ServerConfig(
            port=0, http_port=0, stream_interval_s=0.0, max_concurrent_requests=MAX_CONCURRENT_REQUESTS,
            max_message_bytes=MAX_BODY_BYTES, limits=RequestLimits(max_prompt_bytes=MAX_PROMPT_BYTES),
        )
        server = ServerThread(handle, config)
        # The tiny model's tokenizer ships its chat template (worker/tiny_model.py), as real ones do.
        http = server.start_http(config)
        yield Served(
            f"http://127.0.0.1:{http.port}", f"127.0.0.1:{server.server.port}", "tiny-llama", server,
            load_tokenizer(model_dir), model_dir,
        )
    finally:
        if server is not None:
            server.stop()
        handle.shutdown()


@pytest.fixture
def sdk(served: Served) -> Iterator[openai.OpenAI]:
    # No retries: a 429 or a 503 must reach the test as it was answered.
    with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S) as sdk:
        yield sdk


@pytest.fixture
def grpc_client(served: Served) -> Iterator[Client]:
    with Client(served.grpc_target) as client:
        yield client
