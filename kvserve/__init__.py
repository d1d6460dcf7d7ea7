"""kvserve: a Ray-distributed LLM serving cluster with fleet-wide prefix caching.

The top-level folders of the repository are installed as subpackages:
``kvserve.scheduler`` (control plane), ``kvserve.worker`` (data plane),
``kvserve.kernels``, ``kvserve.cluster``, ``kvserve.proto`` and ``kvserve.bench``.
"""

from kvserve.scheduler.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
