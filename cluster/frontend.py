"""The front end: the ``kvserve.v1.Generation`` servicer, and the request pipeline of every front door.

With ``request_conversion`` (the messages to and from the scheduler actor's
dataclasses), this is the only module that speaks both ``generate_pb2`` and the
actor's ``RequestSpec``, ``RequestDelta`` and ``ReplicaStatsInfo``.  ``responses`` is the pipeline of one request, a
``GenerateRequest`` in and its ``GenerateResponse``s out, with no gRPC in it:
``Generate`` serves it over gRPC and the OpenAI-compatible HTTP API
(``openai_api``) over HTTP, each mapping its ``FrontendError``s to its own
status codes.  It tokenizes and validates each request, hands it to
the scheduler actor, and streams the tokens back with their text, decoded
incrementally.  Remote calls to the actor are few and batched, because each
costs both sides about a millisecond of CPU: the requests that arrive while
one ``add_requests`` call is in flight go together in the next (``request_adder``), and one
background task fetches the outputs of every request (``poll_outputs``, one
call per batch of steps) and routes them to per-request ``OutputStream``s,
which pace the messages of each stream (see ``output_stream.py``).  Outputs
are fetched at that pace too, except while a stream awaits its first tokens.

A call that ends before its request does (cancelled, deadline expired)
aborts the request; until the scheduler's last delta for it (the abort)
comes back, its id is draining: what the request still produced is dropped,
and a new call with the same id (a client retrying) waits for the drain
instead of receiving those outputs.

Every output batch says how many replicas are healthy: ``on_serving_changed``
hears when that number drops to 0 or rises from it (the server's health
status follows).

Status codes: ``INVALID_ARGUMENT`` (naming the field) for bad input and the
request id of a call still draining after ``DRAIN_TIMEOUT_S``; ``ALREADY_EXISTS``
for that of a call in flight; ``RESOURCE_EXHAUSTED`` when ``max_concurrent_requests``
streams are in flight, or ``max_concurrent_requests_per_tenant`` of the caller's
tenant (and, from gRPC itself, for a message over the size limit); ``UNAVAILABLE`` when the request's replica failed while computing it
(a request it had not started goes to another replica) or no replica is
healthy.  A cancelled call or an expired deadline aborts its request.
A client told UNAVAILABLE is told its request id, under which the server log
has the internals: each failed request at DEBUG, and each burst of failures
once at WARNING, with a few of its ids (``FailureLog``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
from ray.exceptions import RayActorError

from kvserve.cluster.detokenizer import IncrementalDetokenizer
from kvserve.cluster.access import Access
from kvserve.cluster.auth import Tenant, TokenTable
from kvserve.cluster.failure_log import FailureLog
from kvserve.cluster.frontend_errors import (
    DuplicateRequestError,
    FrontendError,
    InvalidRequestError,
    OverloadedError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnavailableError,
)
from kvserve.cluster.grpc_auth import authorization_header
from kvserve.cluster.messages import ClusterStatsInfo, ModelInfo, OutputBatch, ReplicaStatsInfo, RequestDelta, RequestSpec
from kvserve.cluster.metrics import FrontendMetrics
from kvserve.cluster.output_poll import POLL_TIMEOUT_S, OutputPoll
from kvserve.cluster.output_stream import OutputStream, StreamPacing, resolve_waiter
from kvserve.cluster.request_adder import RequestAdder
from kvserve.cluster.request_conversion import RequestConversion, client_request_id, to_response, to_stats_response
from kvserve.cluster.ray_errors import remote_error_message
from kvserve.cluster.request_limits import RequestLimits
from kvserve.scheduler.stop_strings import StopStringMatcher
from kvserve.cluster.tolerant_handlers import abort_if_undecodable
from kvserve.proto import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)

# How long a call waits for the cancelled request whose id it reuses to drain.
DRAIN_TIMEOUT_S = 5.0
# Text prompts longer than this are tokenized in a thread: on the event loop the
# tokenizer stalls every stream (about 0.5 ms per thousand characters, a second per megabyte);
# the hand-off to the thread costs about 0.1 ms.
_TOKENIZE_IN_THREAD_CHARS = 1 << 12
# A call cancelled with less than this left of its deadline counts as expired (504), not as left by its
# client (499): the client's deadline starts before the server's (the call's transit, its reading by a
# busy server), so it fires first; 40 concurrent expiries saw 0-20 ms left here, and 19 of 40 counted 499 at 0.
DEADLINE_SLACK_S = 0.1
# Requests that fail within this long of the first are logged as one burst (``FailureLog``).
FAILURE_LOG_WINDOW_S = 1.0
# What a request still running when a front door stops ends with (``end_streams``), and how long a
# front door then gives those answers to be sent.
SHUTTING_DOWN = "the server is shutting down"
END_STREAMS_S = 1.0
# What a client is told once the scheduler actor is gone (the details go to the log).
SCHEDULER_LOST = "the server lost its scheduler; nothing can be served until it is restarted"


class Frontend(generate_pb2_grpc.GenerationServicer):
    """Serves ``Generate`` and ``GetStats`` on top of the scheduler actor.

    Call ``start()`` from the server's event loop before serving and
    ``stop()`` after.  ``on_scheduler_lost`` is called once if the scheduler
    actor dies (the server then reports NOT_SERVING), ``on_serving_changed``
    when no replica is healthy any more (False) or one is again (True).  ``stream_interval_s``
    and ``max_messages_per_s`` pace the messages of the streams, as
    ``ServerConfig`` describes.
    """

    def __init__(
        self,
        scheduler: Any,
        model_info: ModelInfo,
        tokenizer: Any | None,
        *,
        max_concurrent_requests: int,
        max_concurrent_requests_per_tenant: int | None = None,
        stream_interval_s: float = 0.0,
        max_messages_per_s: int | None = None,
        on_scheduler_lost: Callable[[], Awaitable[None]] | None = None,
        on_serving_changed: Callable[[bool], Awaitable[None]] | None = None,
        tokens: TokenTable | None = None,
        monitoring_tenants: frozenset[str] = frozenset(),
        limits: RequestLimits | None = None,
    ) -> None:
        self._scheduler = scheduler
        # The callers' tenants, and those that may read GetStats and /metrics.
        self.access = Access(tokens, monitoring_tenants)
        self.limits = limits or RequestLimits()
        self._conversion = RequestConversion(model_info, tokenizer, self.limits)
        # The errors the front end itself ends streams with: told to clients as they are.
        self._own_errors = {SCHEDULER_LOST}
        self._model_info = model_info
        self._tokenizer = tokenizer
        self._max_concurrent_requests = max_concurrent_requests
        self._max_per_tenant = max_concurrent_requests_per_tenant
        # Streams in flight by tenant name (with a limit per tenant only).
        self._tenant_streams: Counter[str] = Counter()
        self._pacing = StreamPacing(stream_interval_s, max_messages_per_s)
        self._on_scheduler_lost = on_scheduler_lost
        self._on_serving_changed = on_serving_changed
        # Whether some replica was healthy at the last batch that said (the cluster starts ready).
        self._serving = True
        self._streams: dict[str, OutputStream] = {}
        # Requests aborted by their call's end, until their last delta comes (see the module docstring).
        self._draining: dict[str, asyncio.Event] = {}
        # Streams that have not received a token yet: outputs are fetched without pause for them.
        self._awaiting_first: set[str] = set()
        self._pause: asyncio.Future[None] | None = None
        # Requests sent to the scheduler in batches, and their aborts, each sent after its add is answered.
        # Its ``sent``: those sent whose call has not ended, the only ones that can drain; one refused
        # after its call left has no abort to come back: its drain ends then.
        self._adder = RequestAdder(scheduler, abort=self._abort_quietly, on_refused_after_leaving=self._end_drain)
        self._scheduler_error: str | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._poll = OutputPoll(scheduler)
        self._failures = FailureLog(FAILURE_LOG_WINDOW_S)
        self.metrics = FrontendMetrics()

    def start(self) -> None:
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch_outputs(), name="output-dispatcher")

    async def stop(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        self._dispatcher = None
        await self._adder.stop()
        # The stopped dispatcher's poll goes on in the actor unless ended (output_poll.py).
        last = await self._poll.end()
        if last is not None:
            self._route(last)
        self._failures.flush()

    # -- RPCs ------------------------------------------------------------------

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        await abort_if_undecodable(request, context)
        try:
            tenant = None if self.access.tokens is None else self.access.authenticate(
                authorization_header(context.invocation_metadata())
            )
            def expired() -> bool:
                remaining = context.time_remaining()  # None: no deadline
                return remaining is not None and remaining <= DEADLINE_SLACK_S

            # NOTE: aclosing: a call that ends early (cancelled, expired) ends the
            # pipeline at once, which aborts the request and frees its blocks.
            async with aclosing(self.responses(request, tenant=tenant, deadline_passed=expired)) as responses:
                async for response in responses:
                    yield response
        except FrontendError as exc:
            await context.abort(exc.grpc_code, str(exc))

    def responses(
        self, request: generate_pb2.GenerateRequest, *, tenant: Tenant | None = None, measured: bool = True,
        deadline_passed: Callable[[], bool] | None = None,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """``Generate``'s stream of ``request`` without gRPC: every front door's one request pipeline.

        ``tenant`` (from ``authenticate``) keys the request's prefix cache.  Raises a
        ``FrontendError`` (``InvalidRequestError``, ``OverloadedError``,
        ``UnavailableError``), whose type says what to answer.  Leaving the
        iteration before its last message (close it: ``contextlib.aclosing``)
        aborts the request.  Measured in ``metrics`` as one request, unless ``measured`` is false: then
        it is one choice of a request that the caller measures (``FrontendMetrics.track_choices``);
        ``deadline_passed`` tells a call that expired from one the client left.
        """
        responses = self._responses(request, tenant)
        return self.metrics.track(responses, deadline_passed) if measured else responses

    async def _responses(
        self, request: generate_pb2.GenerateRequest, tenant: Tenant | None
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        if request.WhichOneof("prompt") == "text" and len(request.text) > _TOKENIZE_IN_THREAD_CHARS:
            spec = await asyncio.to_thread(self.to_request_spec, request, tenant)
        else:
            spec = self.to_request_spec(request, tenant)
        if self._scheduler_error is not None:
            raise UnavailableError(SCHEDULER_LOST)
        req_id = spec.req_id  # in the tenant's namespace; the client's is public_id
        public_id = client_request_id(tenant, req_id)
        drained = self._draining.get(req_id)
        if drained is not None:
            try:
                await asyncio.wait_for(drained.wait(), DRAIN_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise InvalidRequestError(
                    f"request_id {public_id!r} is still being cancelled after {DRAIN_TIMEOUT_S:g} s"
                ) from None
        if req_id in self._streams:
            raise DuplicateRequestError(f"request_id {public_id!r} is already in flight")
        if len(self._streams) >= self._max_concurrent_requests:
            raise OverloadedError(
                f"the server is at its limit of {self._max_concurrent_requests} concurrent requests"
            )
        counted = self._max_per_tenant is not None and tenant is not None
        if counted and self._tenant_streams[tenant.name] >= self._max_per_tenant:
            raise OverloadedError(
                f"this tenant is at its limit of {self._max_per_tenant} concurrent requests "
                "(max_concurrent_requests_per_tenant)"
            )
        if counted:
            self._tenant_streams[tenant.name] += 1
        stream = OutputStream(req_id, self._pacing)
        self._streams[req_id] = stream
        self._pacing.set_num_streams(len(self._streams))
        self._awaiting_first.add(req_id)
        if self._pause is not None:
            resolve_waiter(self._pause)
        # Leaving before the last delta (cancelled, deadline expired, server
        # stopping) aborts the request, which frees its blocks.
        finished = False
        try:
            try:
                await self._add_request(spec)
            except ValueError as exc:  # Ray's error types also subclass the remote exception's
                finished = True
                raise InvalidRequestError(remote_error_message(exc)) from None
            except (RuntimeError, RayActorError) as exc:
                finished = True
                raise UnavailableError(
                    self._public(req_id, public_id, "no replica can take it now", remote_error_message(exc))
                ) from None
            detokenizer = IncrementalDetokenizer(self._tokenizer) if self._tokenizer is not None else None
            stop = spec.sampling_params.stop if detokenizer is not None else ()
            matcher = StopStringMatcher(stop, spec.sampling_params.min_tokens) if stop else None
            num_output_tokens = 0
            while not finished:
                delta = await stream.next_message()
                if delta.error is not None:
                    finished = True
                    if delta.error in self._own_errors:  # the front end's own words, already for clients
                        raise UnavailableError(delta.error)
                    # NOTE: no replica: it waited for one (a total outage) that did not come back in time.
                    what = (
                        "no replica can take it now" if delta.replica is None
                        else "its replica failed and no other could go on with it"
                    )
                    raise UnavailableError(self._public(req_id, public_id, what, delta.error))
                finished = delta.is_last
                if matcher is None:
                    yield self.to_response(public_id, delta, detokenizer)
                    continue
                response = self.to_response(public_id, delta, None)
                response.text, num_used = matcher.add_tokens(detokenizer, delta.token_ids, is_last=delta.is_last)
                del response.token_ids[num_used:]
                del response.logprobs[num_used:]
                num_output_tokens += num_used
                if matcher.stopped:
                    last = delta if delta.is_last else await self._stop_request(req_id, stream)
                    finished = True
                    response.finish_reason = generate_pb2.FINISH_REASON_STOP
                    response.usage.prompt_tokens = len(spec.prompt_token_ids)
                    response.usage.cached_prompt_tokens = last.num_cached_tokens
                    response.usage.completion_tokens = num_output_tokens
                yield response
        finally:
            del self._streams[req_id]
            if counted:
                self._tenant_streams[tenant.name] -= 1
                if not self._tenant_streams[tenant.name]:
                    del self._tenant_streams[tenant.name]
            self._pacing.set_num_streams(len(self._streams))
            self._awaiting_first.discard(req_id)
            if self._pause is not None:
                resolve_waiter(self._pause)  # the interval is shorter now: the next fetch may be due
            if not finished and not stream.ended:  # an ended request has nothing to abort or drain
                logger.debug("request %s ended early: aborting it", req_id)
                if req_id in self._adder.sent:  # else it never reached the scheduler: no abort will come back
                    self._draining.setdefault(req_id, asyncio.Event())
                self._adder.abort([req_id])
            self._adder.sent.discard(req_id)

    async def _stop_request(self, req_id: str, stream: OutputStream) -> RequestDelta:
        """Abort ``req_id``, whose text reached a stop string, and wait for its last delta (its usage)."""
        self._abort_quietly([req_id])
        while not (delta := await stream.next_message()).is_last:
            pass
        return delta

    async def replica_stats(self) -> list[ReplicaStatsInfo]:
        """Every replica's figures from the scheduler; ``UnavailableError`` once it is gone."""
        try:
            return await self._scheduler.get_stats.remote()
        except RayActorError as exc:
            raise UnavailableError(remote_error_message(exc)) from None

    async def cluster_stats(self) -> ClusterStatsInfo:
        """The scheduler's cluster-wide figures; ``UnavailableError`` once it is gone."""
        try:
            return await self._scheduler.cluster_stats.remote()
        except RayActorError as exc:
            raise UnavailableError(remote_error_message(exc)) from None

    @property
    def is_serving(self) -> bool:
        """Whether requests can be served now: the scheduler is there and some replica is healthy."""
        return self._scheduler_error is None and self._serving

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def tokenizer(self) -> Any | None:
        """The model's tokenizer (``None``: token-id prompts only)."""
        return self._tokenizer

    async def GetStats(
        self, request: generate_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.GetStatsResponse:
        await abort_if_undecodable(request, context)
        try:
            self.access.check_monitoring(self.access.authenticate(authorization_header(context.invocation_metadata())))
            stats = await self.replica_stats()
        except (PermissionDeniedError, UnauthenticatedError, UnavailableError) as exc:
            await context.abort(exc.grpc_code, str(exc))
        return to_stats_response(stats)

    # -- protobuf <-> dataclasses (``request_conversion``) -------------------------

    def to_request_spec(self, request: generate_pb2.GenerateRequest, tenant: Tenant | None = None) -> RequestSpec:
        """Tokenize and validate ``request``; ``InvalidRequestError`` names the bad field or limit."""
        return self._conversion.to_request_spec(request, tenant)

    def to_response(
        self, req_id: str, delta: RequestDelta, detokenizer: IncrementalDetokenizer | None
    ) -> generate_pb2.GenerateResponse:
        return to_response(req_id, delta, detokenizer)

    # -- requests and outputs ----------------------------------------------------

    async def _add_request(self, spec: RequestSpec) -> int | None:
        """Queue ``spec`` for the scheduler (``RequestAdder``); its replica, or the exception it was refused with."""
        return await self._adder.add(spec)

    async def _dispatch_outputs(self) -> None:
        """Fetch every request's outputs from the scheduler and route them to their streams."""
        loop = asyncio.get_running_loop()
        while True:
            poll_start = loop.time()
            try:
                batch = await self._poll.next()
            except RayActorError as exc:
                await self._lose_scheduler(f"the scheduler is gone: {remote_error_message(exc)}")
                return
            except Exception:  # noqa: BLE001 - keep serving; the next poll may succeed
                logger.exception("fetching outputs from the scheduler failed")
                await asyncio.sleep(POLL_TIMEOUT_S)
                continue
            self._route(batch)
            await self._note_health(batch.num_healthy_replicas)
            await self._pause_fetching(poll_start)

    def _route(self, batch: OutputBatch) -> None:
        streams = self._streams
        logprobs, prompt_logprobs = batch.logprobs, batch.prompt_logprobs
        orphans: list[str] = []
        for req_id, token_ids, replica in zip(batch.req_ids, batch.token_ids, batch.replicas):
            stream = streams.get(req_id)
            if stream is None:
                if req_id not in self._draining:  # those are aborted already
                    orphans.append(req_id)
            else:
                stream.add(token_ids, replica, logprobs.get(req_id) if logprobs else None,
                           prompt_logprobs.get(req_id) if prompt_logprobs else None)
        for delta in batch.last_deltas:
            stream = streams.get(delta.req_id)
            if stream is not None:
                stream.end(delta)
            elif self._draining:
                self._end_drain(delta.req_id)
        if self._awaiting_first:
            self._awaiting_first.difference_update(batch.req_ids)
            self._awaiting_first.difference_update(delta.req_id for delta in batch.last_deltas)
        if orphans:
            # Their streams ended before their outputs came: nobody reads them.
            self._abort_quietly(orphans)

    async def _pause_fetching(self, since: float) -> None:
        """Until the pacing interval after ``since`` (loop time) has passed, or a stream awaits its
        first tokens.  NOTE: the interval shrinks as streams end: every end wakes the pause."""
        loop = asyncio.get_running_loop()
        while not self._awaiting_first:
            delay = since + self._pacing.interval_s - loop.time()
            if delay <= 0:
                return
            pause = self._pause = loop.create_future()
            timer = loop.call_later(delay, resolve_waiter, pause)
            try:
                await pause
            finally:
                self._pause = None
                timer.cancel()

    def _end_drain(self, req_id: str) -> None:
        drained = self._draining.pop(req_id, None)
        if drained is not None:
            drained.set()

    async def _note_health(self, num_healthy_replicas: int | None) -> None:
        if num_healthy_replicas is None or (num_healthy_replicas > 0) == self._serving:
            return
        self._serving = num_healthy_replicas > 0
        if self._serving:
            logger.info("a replica is healthy again: serving")
        else:
            # NOTE: a WARNING: the failure that left none has its ERROR already (one per failure).
            logger.warning(
                "no replica is healthy: requests wait for one to be back (--max-queue-wait), then fail with UNAVAILABLE"
            )
        if self._on_serving_changed is not None:
            await self._on_serving_changed(self._serving)

    async def _lose_scheduler(self, reason: str) -> None:
        logger.error("%s", reason)
        self._scheduler_error = reason
        for req_id, stream in self._streams.items():
            stream.end(RequestDelta(req_id, error=SCHEDULER_LOST))
        for drained in self._draining.values():
            drained.set()  # calls waiting on a drain go on, to fail with the reason
        self._draining.clear()
        if self._on_scheduler_lost is not None:
            await self._on_scheduler_lost()

    def end_streams(self, reason: str) -> None:
        """End every stream in flight with ``UNAVAILABLE: reason`` (words for clients) and abort its request."""
        self._own_errors.add(reason)
        req_ids = [req_id for req_id, stream in self._streams.items() if not stream.ended]
        for req_id in req_ids:
            self._streams[req_id].end(RequestDelta(req_id, error=reason))
        if req_ids:
            self._adder.abort(req_ids)

    def _abort_quietly(self, req_ids: list[str]) -> None:
        if self._scheduler_error is not None:
            return
        try:
            self._scheduler.abort_requests.remote(req_ids)
        except Exception:  # noqa: BLE001 - the scheduler going away is handled by the dispatcher
            logger.warning("could not abort %d requests", len(req_ids), exc_info=True)

    def _public(self, req_id: str, public_id: str, what: str, internals: str) -> str:
        """The short message a client gets for a failure whose internals (actor ids, addresses,
        stack details) go to the server log under the request id (``req_id``: with its tenant's name)."""
        self._failures.add(req_id, what, internals)
        return f"request {public_id}: {what} (details in the server log under this request id)"
