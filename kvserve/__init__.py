"""kvserve: a Ray-distributed LLM serving cluster with fleet-wide prefix caching.

The top-level folders of the repository are installed as subpackages:
``kvserve.scheduler`` (control plane), ``kvserve.worker`` (data plane),
``kvserve.kernels``, ``kvserve.cluster``, ``kvserve.proto``, ``kvserve.experiments``
and ``kvserve.bench`` (ARCHITECTURE.md's layers).
"""

from typing import TYPE_CHECKING

from kvserve.scheduler.logprobs import TokenLogprobs
from kvserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.llm import LLM, CompletionOutput, GenerationOutput
    from kvserve.worker.multiproc_executor import WorkerProcessError

__all__ = ["LLM", "CompletionOutput", "GenerationOutput", "SamplingParams", "TokenLogprobs", "WorkerProcessError"]


def __getattr__(name: str):
    # The engine pulls in torch and transformers: import it only when asked for.
    if name in ("LLM", "CompletionOutput", "GenerationOutput"):
        from kvserve import llm

        return getattr(llm, name)
    if name == "WorkerProcessError":  # what generate raises once a tensor-parallel rank has died
        from kvserve.worker.multiproc_executor import WorkerProcessError

        return WorkerProcessError
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
__version__ = "0.1.0"
