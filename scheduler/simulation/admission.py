"""A workload's requests as the simulated replicas' schedulers take them."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.scheduler.request import Request
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.simulation.fleet import FleetConfig, SimulatedRequest


class TrackedRequest(Request):
    """A scheduler ``Request`` that also carries what the simulator records of it.

    NOTE: one object per request, the one the scheduler holds: a step reads
    each running request's next scripted token and progress, and with these
    in a separate record, found through a fleet-wide dict, every request of
    every step cost more reads from memory, the costliest thing a simulation
    does (``kvserve.bench.memory_latency``).  ``simulator_scale`` in one
    process: 411 s with the separate record (752 ns per uncached read that
    day), 317 s without (705 ns).
    """

    __slots__ = ("index", "replica_id", "script", "first_token_time")

    def __init__(
        self,
        index: int,
        req_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        cache_salt: str | None,
        arrival_time: float,
    ) -> None:
        super().__init__(req_id, prompt_token_ids, sampling_params, cache_salt=cache_salt, arrival_time=arrival_time)
        self.index = index
        # The replica it was routed to; None until then.
        self.replica_id: int | None = None
        # The tokens the simulated model samples (its first max_tokens); None until added to a replica.
        self.script: Sequence[int] | None = None
        self.first_token_time: float | None = None


class Admission:
    """Makes the ``TrackedRequest`` of each workload request, after checking it fits the fleet."""

    __slots__ = ("_max_model_len", "_params_by_len")

    def __init__(self, config: FleetConfig) -> None:
        self._max_model_len = config.scheduler_config.max_model_len
        self._params_by_len: dict[int, SamplingParams] = {}

    def request(self, index: int, item: SimulatedRequest) -> TrackedRequest:
        """Request ``index`` of the workload, its script the item's output tokens if it has them.

        Raises ``ValueError`` naming the request when it needs more than
        ``max_model_len`` tokens or scripts fewer tokens than it generates.
        """
        output_len = item.output_len
        params = self._params_by_len.get(output_len)
        if params is None:
            params = self._params_by_len[output_len] = SamplingParams(max_tokens=output_len, ignore_eos=True)
        num_prompt_tokens = len(item.prompt_token_ids)
        if num_prompt_tokens + output_len > self._max_model_len:
            # The scheduler would stop it short of output_len tokens.
            raise ValueError(
                f"request {index} cannot be served: {num_prompt_tokens} prompt + {output_len} output tokens "
                f"exceed max_model_len={self._max_model_len}"
            )
        script = item.output_token_ids
        if script is not None and len(script) < output_len:
            raise ValueError(f"request {index} gives {len(script)} output tokens but asks for {output_len}")
        request = TrackedRequest(
            index, str(index), item.prompt_token_ids, params, cache_salt=item.cache_salt, arrival_time=item.arrival_time
        )
        request.script = script
        return request
