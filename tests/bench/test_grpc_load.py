"""The load client's timed exchange, which ``bench/long_prompts.py`` judges the next turn by: real
serve over real gRPC."""

from __future__ import annotations

import grpc
from grpc_load import chat_body, exchange, request_messages
from stack import MODEL, ServeProcess

from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc


async def test_an_exchange_names_the_pick_and_times_the_routing_answer_within_the_stream(
    serve_two_endpoints: tuple[ServeProcess, list[str]],
) -> None:
    serve, endpoints = serve_two_endpoints
    async with grpc.aio.insecure_channel(f"127.0.0.1:{serve.grpc_port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
        timed = [await exchange(stub, request_messages(chat_body(MODEL))) for _ in range(5)]
    assert all(t.destination.split(",")[0] in endpoints for t in timed)
    # The routing answer comes before the body echoed back, the response-headers exchange and the
    # close: it is a part of the whole stream, never all of it.
    assert all(0 < t.decided_s < t.whole_s for t in timed)
