"""A stand-in GPU worker for benchmarks of the step loop: a launch's host time, a device's time, no model.

``EmulatedGpuWorker`` has the step servicer's ``StepRunner`` shape and launches like a CUDA
``Worker``: ``launch`` keeps its thread busy for the step's host time, as queuing a step's
kernels does (letting go of the GIL every 20 us, as torch's ops do), and returns; the step
is done on its "device" its device time after the later of its launch and the previous
step's end (``EmulatedGpu``: the two times of a step).  Rank 0 of one: it answers every step with the
simulator's synthetic tokens (a function of request id and position), so any two
schedules of the same requests give the same outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.scheduler.simulation.simulated_executor import synthetic_step_result
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult

VOCAB_SIZE = 32_000
# The host time of one op's launch, after which the GIL is let go (about a torch op's).
_OP_S = 20e-6


@dataclass(frozen=True, slots=True)
class EmulatedGpu:
    """The stand-in worker's two costs per step, in milliseconds, and its pool's size.

    A step with prompt tokens (a request with more than one scheduled token) is launched
    eagerly on a GPU, where a decode-only step replays a CUDA graph: its host time is
    ``prefill_host_ms`` (``None``: ``host_ms``).  Every step's device time is ``device_ms``
    plus ``device_us_per_token`` per scheduled token.
    """

    host_ms: float
    device_ms: float
    num_blocks: int
    prefill_host_ms: float | None = None
    device_us_per_token: float = 0.0

    def costs_ms(self, plan: StepPlan) -> tuple[float, float]:
        """``plan``'s host and device milliseconds."""
        tokens = sum(plan.num_scheduled_tokens)
        prefill = tokens > len(plan.num_scheduled_tokens)
        host_ms = self.prefill_host_ms if prefill and self.prefill_host_ms is not None else self.host_ms
        return host_ms, self.device_ms + tokens * self.device_us_per_token / 1e3


class EmulatedStep:
    """A launched step: done on the emulated device at ``done_at`` (``time.perf_counter``)."""

    def __init__(self, done_at: float, result: StepResult) -> None:
        self._done_at = done_at
        self._result = result

    def wait(self) -> None:
        delay = self._done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def result(self) -> StepResult:
        self.wait()
        return self._result


class EmulatedGpuWorker:
    """A ``StepRunner`` that launches like a GPU worker, without a model (module docstring)."""

    launches_ahead = True

    def __init__(self, gpu: EmulatedGpu) -> None:
        self.gpu = gpu
        self._device_free_at = 0.0
        # Steps launched, and their host and device milliseconds summed (the host's and the
        # device's work each run one step after another: the larger sum is the run's floor).
        self.num_launched = 0
        self.launched_host_ms = 0.0
        self.launched_device_ms = 0.0

    @property
    def num_kv_blocks(self) -> int:
        return self.gpu.num_blocks

    def determine_num_blocks(self) -> int:
        return self.gpu.num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        pass

    def launch(self, plan: StepPlan) -> EmulatedStep:
        start = time.perf_counter()
        host_ms, device_ms = self.gpu.costs_ms(plan)
        self.num_launched += 1
        self.launched_host_ms += host_ms
        self.launched_device_ms += device_ms
        host_end = start + host_ms / 1e3
        result = synthetic_step_result(plan, VOCAB_SIZE)
        # The host's work to queue the step: torch's op bindings let go of the GIL around each
        # op's dispatch, so other threads (the servicer's reader and waiter) get it between ops.
        while (now := time.perf_counter()) < host_end:
            slice_end = min(now + _OP_S, host_end)
            while time.perf_counter() < slice_end:
                pass
            time.sleep(0)  # lets go of the GIL
        self._device_free_at = max(self._device_free_at, host_end) + device_ms / 1e3
        return EmulatedStep(self._device_free_at, result)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).result()

    def shutdown(self) -> None:
        pass
