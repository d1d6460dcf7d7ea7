"""gRPC method handlers whose requests may fail to decode without grpc answering UNKNOWN.

grpc's generated ``add_*Servicer_to_server`` decodes each request with the
message's ``FromString``; a body that is not a valid message (a string field
of bad UTF-8, a corrupt wire format) then ends the call with ``UNKNOWN`` and
logs a traceback at ERROR for every such request, so that any client can
flood the server's log.  Here the decoder returns an ``UndecodableRequest``
instead, which the servicer answers with ``INVALID_ARGUMENT``
(``abort_if_undecodable``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass


@dataclass(frozen=True, slots=True)
class UndecodableRequest:
    """A request body that is not a valid message of the method's request type."""

    message: str


def tolerant_decoder(message_type: type[Message]) -> Callable[[bytes], Message | UndecodableRequest]:
    """``message_type.FromString``, returning an ``UndecodableRequest`` where it raises."""
    full_name = message_type.DESCRIPTOR.full_name

    def decode(data: bytes) -> Message | UndecodableRequest:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return UndecodableRequest(f"the request is not a valid {full_name}: {exc}")

    return decode


async def abort_if_undecodable(request: object, context: grpc.aio.ServicerContext) -> None:
    """End the call with ``INVALID_ARGUMENT`` when ``request`` could not be decoded."""
    if isinstance(request, UndecodableRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def add_tolerant_service(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Register ``servicer``'s method of each of ``service``'s RPCs, as the generated
    ``add_*Servicer_to_server`` does but with ``tolerant_decoder``: unary requests only."""
    handlers = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name} streams requests: only unary requests are decoded here")
        make_handler = (
            grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=tolerant_decoder(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
