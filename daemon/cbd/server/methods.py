"""The Cbd service's method handlers, built from the proto's service descriptor.

grpc runs a handler's request deserializer before the handler and turns any exception it raises
into UNKNOWN. So every method is registered here with raw bytes in: the handler parses them itself
and a request that is not a valid message ends with INVALID_ARGUMENT through `status.abort` (the one
place errors become status codes), naming the message type. Interceptors (auth) run before any of
this, so an unauthenticated caller learns nothing about its bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from cbd.errors import InvalidRequest
from cbd.server import status
from cbd_client.v1 import cbd_pb2

SERVICE = cbd_pb2.DESCRIPTOR.services_by_name["Cbd"]


def add_cbd_service(servicer: object, server: grpc.aio.Server) -> None:
    """Register every method of cbd.v1.Cbd on `server`, served by the same-named methods of `servicer`."""
    handlers = {method.name: _handler(method, getattr(servicer, method.name)) for method in SERVICE.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


async def _parse(message_class: type[Message], data: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return message_class.FromString(data)
    except DecodeError:
        await status.abort(context, InvalidRequest(f"the request is not a valid {message_class.DESCRIPTOR.full_name}"))


def _handler(method: MethodDescriptor, behaviour: Callable[..., Any]) -> grpc.RpcMethodHandler:
    if method.client_streaming:
        raise TypeError(f"{method.full_name}: client-streaming methods are not served")
    request_class = GetMessageClass(method.input_type)
    serialize = GetMessageClass(method.output_type).SerializeToString
    if method.server_streaming:

        async def stream(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            request = await _parse(request_class, data, context)
            async for response in behaviour(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream, response_serializer=serialize)

    async def unary(data: bytes, context: grpc.aio.ServicerContext) -> Message:
        return await behaviour(await _parse(request_class, data, context), context)

    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serialize)
