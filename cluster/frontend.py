"""The front end: the ``kvserve.v1.Generation`` servicer.

This is the only module that converts between ``generate_pb2`` messages and
the scheduler actor's dataclasses (``RequestSpec``, ``RequestDelta``,
``ReplicaStatsInfo``).  It tokenizes and validates each request, hands it to
the scheduler actor, and streams the tokens back with their text, decoded
incrementally.  One background task fetches the outputs of every request from
the actor (``poll_outputs``, one call per batch of steps) and routes them to
per-request queues.

Status codes: ``INVALID_ARGUMENT`` (naming the field) for bad input and
duplicate request ids; ``RESOURCE_EXHAUSTED`` when ``max_concurrent_requests``
streams are in flight (and, from gRPC itself, for a message over the size
limit); ``UNAVAILABLE`` when the request's replica failed or no replica is
healthy.  A cancelled call or an expired deadline aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from ray.exceptions import RayActorError

from kvserve.cluster.detokenizer import IncrementalDetokenizer
from kvserve.cluster.messages import ModelInfo, ReplicaStatsInfo, RequestDelta, RequestSpec
from kvserve.cluster.ray_errors import remote_error_message
from kvserve.proto import generate_pb2, generate_pb2_grpc
from kvserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_LENGTH = 256
_POLL_TIMEOUT_S = 1.0
_FINISH_REASONS = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}


class InvalidRequestError(ValueError):
    """A request that can never be served as sent; the message names the field."""


class Frontend(generate_pb2_grpc.GenerationServicer):
    """Serves ``Generate`` and ``GetStats`` on top of the scheduler actor.

    Call ``start()`` from the server's event loop before serving and
    ``stop()`` after.  ``on_scheduler_lost`` is called once if the scheduler
    actor dies (the server then reports NOT_SERVING).
    """

    def __init__(
        self,
        scheduler: Any,
        model_info: ModelInfo,
        tokenizer: Any | None,
        *,
        max_concurrent_requests: int,
        stream_interval_s: float = 0.0,
        on_scheduler_lost: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._model_info = model_info
        self._tokenizer = tokenizer
        self._max_concurrent_requests = max_concurrent_requests
        self._stream_interval_s = stream_interval_s
        self._on_scheduler_lost = on_scheduler_lost
        self._streams: dict[str, asyncio.Queue[RequestDelta]] = {}
        self._scheduler_error: str | None = None
        self._dispatcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch_outputs(), name="output-dispatcher")

    async def stop(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
            self._dispatcher = None

    # -- RPCs ------------------------------------------------------------------

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            spec = self.to_request_spec(request)
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._scheduler_error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._scheduler_error)
        if spec.req_id in self._streams:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id {spec.req_id!r} is already in flight"
            )
        if len(self._streams) >= self._max_concurrent_requests:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is at its limit of {self._max_concurrent_requests} concurrent requests",
            )
        req_id = spec.req_id
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self._streams[req_id] = queue
        # Leaving before the last delta (cancelled, deadline expired, server
        # stopping) aborts the request, which frees its blocks.
        finished = False
        try:
            try:
                await self._scheduler.add_request.remote(spec)
            except ValueError as exc:  # Ray's error types also subclass the remote exception's
                finished = True
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, remote_error_message(exc))
            except (RuntimeError, RayActorError) as exc:
                finished = True
                await context.abort(grpc.StatusCode.UNAVAILABLE, remote_error_message(exc))
            detokenizer = IncrementalDetokenizer(self._tokenizer) if self._tokenizer is not None else None
            while not finished:
                delta = await queue.get()
                if not queue.empty():
                    # This stream fell behind: its deltas travel as one message.
                    delta = _merge_deltas([delta, *_drain(queue)])
                if delta.error is not None:
                    finished = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, delta.error)
                finished = delta.is_last
                yield self.to_response(req_id, delta, detokenizer)
        finally:
            del self._streams[req_id]
            if not finished:
                logger.debug("request %s ended early: aborting it", req_id)
                self._abort_quietly([req_id])

    async def GetStats(
        self, request: generate_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GetStatsResponse:
        try:
            stats: list[ReplicaStatsInfo] = await self._scheduler.get_stats.remote()
        except RayActorError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, remote_error_message(exc))
        return generate_pb2.GetStatsResponse(
            replicas=[
                generate_pb2.ReplicaStats(
                    replica=s.replica,
                    num_running=s.num_running,
                    num_waiting=s.num_waiting,
                    kv_cache_usage=s.kv_cache_usage,
                    prefix_cache_hit_rate=s.prefix_cache_hit_rate,
                    healthy=s.healthy,
                    num_kv_blocks=s.num_kv_blocks,
                )
                for s in stats
            ]
        )

    # -- protobuf <-> dataclasses ----------------------------------------------

    def to_request_spec(self, request: generate_pb2.GenerateRequest) -> RequestSpec:
        """Tokenize and validate ``request``; ``InvalidRequestError`` names the bad field."""
        model = self._model_info
        vocab_size = model.vocab_size
        req_id = request.request_id or uuid.uuid4().hex
        if len(req_id) > MAX_REQUEST_ID_LENGTH:
            raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters")
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt is missing: set text or token_ids")
        if kind == "text":
            if not request.text:
                raise InvalidRequestError("text is empty")
            if self._tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer and this model has none: send token_ids")
            prompt_token_ids = list(self._tokenizer(request.text)["input_ids"])
            if not prompt_token_ids:
                raise InvalidRequestError("text tokenizes to no tokens")
        else:
            prompt_token_ids = list(request.token_ids.ids)
            if not prompt_token_ids:
                raise InvalidRequestError("token_ids is empty")
            for token_id in prompt_token_ids:
                if not 0 <= token_id < vocab_size:
                    raise InvalidRequestError(
                        f"token_ids: {token_id} is outside the vocabulary [0, {vocab_size})"
                    )
        sampling_params = self._to_sampling_params(request.sampling_params)
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens + sampling_params.max_tokens > model.max_model_len:
            field = "text" if kind == "text" else "token_ids"
            if num_prompt_tokens >= model.max_model_len:
                raise InvalidRequestError(
                    f"{field}: the prompt has {num_prompt_tokens} tokens; max_model_len is {model.max_model_len}"
                )
            raise InvalidRequestError(
                f"sampling_params.max_tokens: {num_prompt_tokens} prompt tokens + max_tokens "
                f"{sampling_params.max_tokens} exceed max_model_len {model.max_model_len}"
            )
        return RequestSpec(
            req_id=req_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params,
            cache_salt=request.cache_salt or None,
        )

    def _to_sampling_params(self, params: generate_pb2.SamplingParams) -> SamplingParams:
        vocab_size = self._model_info.vocab_size
        for token_id in params.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"sampling_params.stop_token_ids: {token_id} is outside the vocabulary [0, {vocab_size})"
                )
        kwargs: dict[str, Any] = {
            "stop_token_ids": tuple(params.stop_token_ids),
            "ignore_eos": params.ignore_eos,
        }
        for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            if params.HasField(name):
                kwargs[name] = getattr(params, name)
        try:
            # SamplingParams validates every field and names it in its message.
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise InvalidRequestError(f"sampling_params.{exc}") from None

    def to_response(
        self, req_id: str, delta: RequestDelta, detokenizer: IncrementalDetokenizer | None
    ) -> generate_pb2.GenerateResponse:
        text = ""
        if detokenizer is not None:
            text = detokenizer.add(delta.token_ids)
            if delta.is_last:
                text += detokenizer.flush()
        response = generate_pb2.GenerateResponse(
            request_id=req_id, token_ids=delta.token_ids, text=text, replica=delta.replica
        )
        if delta.finish_reason is not None:
            response.finish_reason = _FINISH_REASONS[delta.finish_reason]
            response.usage.prompt_tokens = delta.num_prompt_tokens
            response.usage.cached_prompt_tokens = delta.num_cached_tokens
            response.usage.completion_tokens = delta.num_output_tokens
        return response

    # -- outputs ---------------------------------------------------------------

    async def _dispatch_outputs(self) -> None:
        """Fetch every request's outputs from the scheduler and route them to their streams."""
        loop = asyncio.get_running_loop()
        while True:
            poll_start = loop.time()
            try:
                deltas: list[RequestDelta] = await self._scheduler.poll_outputs.remote(_POLL_TIMEOUT_S)
            except RayActorError as exc:
                await self._lose_scheduler(f"the scheduler is gone: {remote_error_message(exc)}")
                return
            except Exception:  # noqa: BLE001 - keep serving; the next poll may succeed
                logger.exception("fetching outputs from the scheduler failed")
                await asyncio.sleep(_POLL_TIMEOUT_S)
                continue
            orphans: list[str] = []
            streams = self._streams
            for delta in deltas:
                queue = streams.get(delta.req_id)
                if queue is not None:
                    queue.put_nowait(delta)
                elif not delta.is_last:
                    orphans.append(delta.req_id)
            if orphans:
                # Their streams ended before their outputs came: nobody reads them.
                self._abort_quietly(orphans)
            # NOTE: the tokens of the steps until the next poll travel together:
            # a stream interval trades latency for fewer messages per token.
            wait_s = poll_start + self._stream_interval_s - loop.time()
            if wait_s > 0:
                await asyncio.sleep(wait_s)

    async def _lose_scheduler(self, reason: str) -> None:
        logger.error("%s", reason)
        self._scheduler_error = reason
        for req_id, queue in self._streams.items():
            queue.put_nowait(RequestDelta(req_id, error=reason))
        if self._on_scheduler_lost is not None:
            await self._on_scheduler_lost()

    def _abort_quietly(self, req_ids: list[str]) -> None:
        if self._scheduler_error is not None:
            return
        try:
            self._scheduler.abort_requests.remote(req_ids)
        except Exception:  # noqa: BLE001 - the scheduler going away is handled by the dispatcher
            logger.warning("could not abort %d requests", len(req_ids), exc_info=True)


def _drain(queue: asyncio.Queue[RequestDelta]) -> list[RequestDelta]:
    deltas = []
    while not queue.empty():
        deltas.append(queue.get_nowait())
    return deltas


def _merge_deltas(deltas: list[RequestDelta]) -> RequestDelta:
    """One delta with the tokens of ``deltas`` (in order) and the last one's end, if any."""
    last = deltas[-1]
    return RequestDelta(
        req_id=last.req_id,
        token_ids=[t for delta in deltas for t in delta.token_ids],
        finish_reason=last.finish_reason,
        error=last.error,
        num_prompt_tokens=last.num_prompt_tokens,
        num_cached_tokens=last.num_cached_tokens,
        num_output_tokens=last.num_output_tokens,
        replica=last.replica,
    )
