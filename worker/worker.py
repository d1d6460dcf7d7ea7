"""One rank of one replica: model shard, paged KV cache, and step execution.

No Ray and no gRPC here: the cluster wraps a ``Worker`` in an actor, the
in-process engine uses it directly.  Lifecycle::

    worker = Worker(config)                 # device, torch.distributed, weights
    num_blocks = worker.determine_num_blocks()
    worker.initialize_cache(min over ranks of num_blocks)
    result = worker.execute(plan)           # every step; rank 0 returns samples
    worker.shutdown()
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig

from kvserve.kernels import get_attention_backend
from kvserve.kernels.host_to_device import to_device
from kvserve.scheduler.checks import check_num_blocks
from kvserve.scheduler.cores import available_cores
from kvserve.scheduler.step_plan import StepPlan
from kvserve.scheduler.step_result import StepResult
from kvserve.worker.cuda_graphs import DEFAULT_MAX_SEQ_LEN_TO_CAPTURE, DecodeGraphs, graph_batch_sizes
from kvserve.worker.distributed import TensorParallelGroup, init_distributed
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    cuda_kv_cache_budget,
    num_blocks_for_budget,
)
from kvserve.worker.logits_adjuster import LogitsAdjuster
from kvserve.worker.prompt_logprobs import PromptLogprobsOnDevice, compute_prompt_logprobs
from kvserve.worker.model_loader import load_model
from kvserve.worker.sampler import Sampler, SamplerOutput
from kvserve.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: WorkerConfig) -> torch.device:
    """The worker's device: ``config.device``, else a GPU when there is one; a GPU always by index.

    ``"cuda"`` without an index means the rank's GPU among those visible (one per Ray
    actor, which sees only its own).  NOTE: ``torch.cuda.set_device`` refuses a CUDA
    device without an index (torch 2.11: "Expected a torch.device with a specified index").
    """
    if config.device is not None:
        device = torch.device(config.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" or device.index is not None:
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} was asked for, but no CUDA device is visible")
    return torch.device("cuda", config.rank % torch.cuda.device_count())


def resolve_dtype(config: WorkerConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Worker:
    """Holds one rank's model shard and KV cache and executes step plans."""

    def __init__(self, config: WorkerConfig) -> None:
        if config.tp_size > 1 and not config.distributed_init_method:
            raise ValueError("distributed_init_method is required when tp_size > 1")
        self.config = config
        self.device = resolve_device(config)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif config.cpu_threads is not None or config.tp_size > 1:
            # NOTE: ranks of one replica share the host's cores; oversubscribed
            # OpenMP threads spin against each other and slow a step tenfold.
            torch.set_num_threads(config.cpu_threads or max(1, available_cores() // config.tp_size))
        self.dtype = resolve_dtype(config, self.device)
        self.tp: TensorParallelGroup = init_distributed(
            config.rank, config.tp_size, config.distributed_init_method or ""
        )
        self.hf_config = AutoConfig.from_pretrained(config.model_dir)
        backend = get_attention_backend(self.device, config.attention_backend)
        self.model = load_model(
            config.model_dir, self.tp, dtype=self.dtype, device=self.device, attention_backend=backend,
            max_model_len=config.max_model_len,
        )
        self.sampler = Sampler(seed=config.sampler_seed)
        # Rank 0 samples, and keeps what penalties, biases and min_tokens need.
        self.logits_adjuster = LogitsAdjuster(self.hf_config.vocab_size, self.device) if self.is_driver else None
        self.max_model_len = config.max_model_len or self.hf_config.max_position_embeddings
        # CUDA graphs need the CUDA kernels (the others plan on the host per batch).
        self.use_cuda_graphs = self.device.type == "cuda" and backend.name == "cuda" and not config.enforce_eager
        self.input_batch = InputBatch(
            config.block_size, self.device,
            max_blocks_per_req=-(-self.max_model_len // config.block_size) if self.use_cuda_graphs else None,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.decode_graphs: DecodeGraphs | None = None
        # The last sampling step's plan and its samples, on the device (None on ranks
        # other than 0 until a plan with placeholders makes rank 0 send them).
        self._last_sampled: tuple[StepPlan, torch.Tensor | None] | None = None

    @property
    def launches_ahead(self) -> bool:
        """Whether ``launch`` returns before the device ran the step (CUDA): a server of the
        step protocol then launches the next plan before it waits for this one's result."""
        return self.device.type == "cuda"

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns tokens."""
        return self.config.rank == 0

    def kv_cache_spec(self) -> KVCacheSpec:
        # NOTE: the model's own shape, which its attention layers check the cache against:
        # one rule for this rank's KV heads and the head size, not a second reading of config.json.
        _, _, num_local_kv_heads, head_dim = self.model.kv_cache_shape(1, self.config.block_size)
        return KVCacheSpec(
            num_layers=self.hf_config.num_hidden_layers,
            block_size=self.config.block_size,
            num_local_kv_heads=num_local_kv_heads,
            head_dim=head_dim,
            dtype=self.dtype,
        )

    def determine_num_blocks(self) -> int:
        """Blocks this rank can hold; the replica uses the minimum over its ranks."""
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        spec = self.kv_cache_spec()
        if self.device.type == "cuda":
            utilization = self.config.gpu_memory_utilization
            budget = cuda_kv_cache_budget(self.device, utilization)
            setting = f"gpu_memory_utilization is {utilization}"
        else:
            budget = self.config.cpu_kv_cache_bytes
            setting = f"cpu_kv_cache_bytes is {budget}"
        return num_blocks_for_budget(spec, budget, setting)

    def initialize_cache(self, num_blocks: int) -> None:
        check_num_blocks(num_blocks)
        self.kv_caches = allocate_kv_cache(self.kv_cache_spec(), num_blocks, self.device)
        self.num_blocks = num_blocks
        if self.use_cuda_graphs:
            self._capture_decode_graphs()

    @torch.inference_mode()
    def _capture_decode_graphs(self) -> None:
        assert self.input_batch.device_block_table is not None  # created with use_cuda_graphs
        graphs = DecodeGraphs(
            self._forward,
            self.input_batch.device_block_table,
            batch_sizes=graph_batch_sizes(self.config.max_num_seqs),
            max_seq_len=min(self.max_model_len, DEFAULT_MAX_SEQ_LEN_TO_CAPTURE),
            block_size=self.config.block_size,
            device=self.device,
        )
        seconds = graphs.capture()
        self.decode_graphs = graphs
        logger.info(
            "captured %d CUDA graphs for decode steps of up to %d requests (contexts up to %d tokens) in %.1f s",
            graphs.num_graphs, graphs.batch_sizes[-1], graphs.max_seq_len, seconds,
        )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, attn_metadata)

    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run ``plan``; rank 0 returns the sampled tokens, other ranks ``None``."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue ``plan``'s work on the device; its result comes from ``LaunchedStep.result()``.

        On CUDA nothing here waits for the device, so the caller can plan the next
        step meanwhile.  The next plan's placeholder rows take this step's samples.
        """
        if not self.kv_caches:
            raise RuntimeError("initialize_cache() must be called before execute()")
        batch = self.input_batch
        batch.apply(plan)
        adjuster = self.logits_adjuster
        if adjuster is not None:
            adjuster.apply_plan(plan)
        if not plan.req_ids:
            return LaunchedStep(plan.step_id, self.is_driver)
        graphs = self.decode_graphs
        # NOTE: prompt logprobs need the hidden states of whole chunks: such a step runs eagerly.
        decode = batch.prepare_decode(plan) if graphs is not None and not plan.prompt_logprobs_rows else None
        padded_size = graphs.padded_size(decode) if graphs is not None and decode is not None else None
        if padded_size is not None:
            fix = None
            if plan.placeholder_rows:  # a decode step's row r is its token r
                fix = lambda input_ids: self._fill_placeholders(plan, input_ids, range(decode.num_reqs))  # noqa: E731
            hidden_states = graphs.run(decode, padded_size, fix_input_ids=fix)
            prompt = None
            sampling_params, output_indices = decode.sampling_params, decode.output_indices
            logits_rows = (
                hidden_states if len(output_indices) == decode.num_reqs
                else hidden_states[to_device(decode.logits_indices, self.device)]
            )
        else:
            inputs = batch.prepare(plan)
            self._fill_placeholders(plan, inputs.input_ids, inputs.attn_metadata.query_start_loc_cpu)
            hidden_states = self._forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            prompt = None
            if plan.prompt_logprobs_rows:
                prompt = compute_prompt_logprobs(
                    self.model.compute_logits, hidden_states, plan, inputs.states,
                    inputs.attn_metadata.query_start_loc_cpu,
                    vocab_size=self.hf_config.vocab_size, keep=self.is_driver,
                )
            sampling_params, output_indices = inputs.sampling_params, inputs.output_indices
            logits_rows = hidden_states[inputs.logits_indices] if output_indices else None
        if not output_indices:
            return LaunchedStep.copying(plan.step_id, None, prompt) if prompt else LaunchedStep(plan.step_id, self.is_driver)
        logits = self.model.compute_logits(logits_rows)
        if not self.is_driver:
            # Rank 0 samples; the next plan's placeholders get its samples then (_last_samples).
            self._last_sampled = (plan, None)
            return LaunchedStep(plan.step_id, False)
        adjustments = None
        if adjuster is not None and adjuster.num_requests:
            sampled_req_ids = [req_id for req_id, sample in zip(plan.req_ids, plan.sample) if sample]
            adjustments = adjuster.prepare(sampled_req_ids, output_indices)
        sampled = self.sampler(logits, sampling_params, output_indices, adjustments)
        if adjustments is not None:
            adjuster.record(adjustments, sampled.token_ids)
        # For the next plan's placeholders (overlapped scheduling), if it has any.
        self._last_sampled = (plan, sampled.token_ids)
        return LaunchedStep.copying(plan.step_id, sampled, prompt)

    def _fill_placeholders(self, plan: StepPlan, input_ids: torch.Tensor, token_index_of_row) -> None:
        """Put the last step's samples into ``input_ids`` at ``plan``'s placeholder rows.

        ``token_index_of_row[r]``: where row ``r``'s token sits in ``input_ids``.
        """
        if not plan.placeholder_rows:
            return
        last_plan, last_token_ids = self._last_samples(plan)
        # Each request the last step sampled: its index among that step's samples.
        sample_index = {last_plan.req_ids[i]: k for k, i in enumerate(i for i, s in enumerate(last_plan.sample) if s)}
        try:
            sources = [sample_index[plan.req_ids[row]] for row in plan.placeholder_rows]
        except KeyError as exc:
            raise ValueError(f"step {plan.step_id}: request {exc.args[0]!r} has a placeholder but was not "
                             "sampled by the previous step") from None
        targets = [int(token_index_of_row[row]) for row in plan.placeholder_rows]
        input_ids[to_device(np.asarray(targets, dtype=np.int64), self.device)] = last_token_ids[
            to_device(np.asarray(sources, dtype=np.int64), self.device)
        ]

    def _last_samples(self, plan: StepPlan) -> tuple[StepPlan, torch.Tensor]:
        """The last sampling step's plan and its samples, on this rank's device.

        Only rank 0 samples: with tensor parallelism it sends them to the other ranks
        here, when a plan needs them (every rank gets the same plans, so all of them
        meet in this broadcast), and never for steps without placeholders.
        """
        if self._last_sampled is None:
            raise ValueError(f"step {plan.step_id} has placeholders but no step sampled before it")
        last_plan, token_ids = self._last_sampled
        if self.tp.world_size > 1:
            if token_ids is None:
                token_ids = torch.empty(last_plan.num_sampled, dtype=torch.int64, device=self.device)
            self.tp.broadcast(token_ids, src=0)
            self._last_sampled = (last_plan, token_ids)
        return last_plan, token_ids

    def shutdown(self) -> None:
        """Release the graphs, the KV cache and the weights (and the process group).

        On CUDA the memory goes back to the device, so that another worker (or a new
        ``LLM``) in this process can size its cache from the whole GPU again.
        """
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None
        self.kv_caches = []
        self.input_batch = InputBatch(self.config.block_size, torch.device("cpu"))
        self._last_sampled = None
        self.logits_adjuster = None
        self.model = None
        if self.config.tp_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A step whose work is queued on the device; rank 0's samples are on their way to the host.

    The samples (tokens, and logprobs for the requests that asked) travel in one
    copy (``SamplerOutput.pack``), the prompt logprobs, when the plan asked, in a
    second, and ``result()`` is the step's one wait.
    """

    step_id: int
    is_driver: bool
    sampled: SamplerOutput | None = None
    packed: torch.Tensor | None = None  # on the host (pinned on CUDA), complete once `ready` passed
    ready: torch.cuda.Event | None = None
    prompt: PromptLogprobsOnDevice | None = None
    prompt_packed: torch.Tensor | None = None  # like `packed`

    @classmethod
    def copying(
        cls, step_id: int, sampled: SamplerOutput | None, prompt: PromptLogprobsOnDevice | None = None
    ) -> LaunchedStep:
        """The step whose samples are ``sampled`` (and prompt logprobs ``prompt``), copied to the host
        without a wait."""
        packed = sampled.pack() if sampled is not None else None
        prompt_packed = prompt.packed if prompt is not None else None
        on_device = [t for t in (packed, prompt_packed) if t is not None]
        if not on_device or on_device[0].device.type != "cuda":
            return cls(step_id, True, sampled, packed, None, prompt, prompt_packed)
        packed, prompt_packed = (t.to("cpu", non_blocking=True) if t is not None else None for t in (packed, prompt_packed))
        ready = torch.cuda.Event()
        ready.record()
        return cls(step_id, True, sampled, packed, ready, prompt, prompt_packed)

    def wait(self) -> None:
        """Block until the device ran the step (from any thread); ``result()`` then waits no more."""
        if self.ready is not None:
            self.ready.synchronize()

    def result(self) -> StepResult | None:
        """The sampled tokens (rank 0) after one wait for the device; ``None`` on other ranks.

        From any thread: the step server answers from its RPC thread while the worker thread
        launches the next step.  It reads host copies only (no torch state of the worker)."""
        if not self.is_driver:
            return None
        if self.ready is not None:
            self.ready.synchronize()
        token_ids, logprobs = [], None
        if self.sampled is not None and self.packed is not None:
            token_ids, logprobs = self.sampled.unpack(self.packed)
        prompt_logprobs = None
        if self.prompt is not None and self.prompt_packed is not None:
            prompt_logprobs = self.prompt.unpack(self.prompt_packed)
        return StepResult(self.step_id, token_ids, logprobs, prompt_logprobs)
