"""Client-chosen request ids: echoed back and logged, so refused when they could forge a log line."""

from __future__ import annotations

import grpc
import pytest

from kvserve.cluster.auth import Tenant
from kvserve.cluster.frontend_errors import InvalidRequestError
from kvserve.cluster.messages import ModelInfo
from kvserve.cluster.request_conversion import RequestConversion, client_request_id
from kvserve.cluster.request_limits import RequestLimits
from kvserve.proto import generate_pb2

INFO = ModelInfo(model_dir="unused", vocab_size=10, max_model_len=64, eos_token_ids=(), num_replicas=1)


def to_spec(request_id: str, tenant: Tenant | None = None):
    request = generate_pb2.GenerateRequest(request_id=request_id, token_ids=generate_pb2.TokenIds(ids=[1, 2]))
    return RequestConversion(INFO, None, RequestLimits()).to_request_spec(request, tenant)


@pytest.mark.parametrize(
    ("request_id", "code_point", "position"),
    [
        ("id\nINFO forged line", "U+000A", 3),
        ("id\x1b[2Kcleared", "U+001B", 3),
        ("id\rback", "U+000D", 3),
        ("id\x00nul", "U+0000", 3),
        ("id\u202etxt.exe", "U+202E", 3),  # a bidi override (category Cf) reorders what a reader sees
        ("\x85next-line", "U+0085", 1),
    ],
)
def test_a_request_id_with_a_control_character_is_refused_naming_the_field(request_id, code_point, position):
    with pytest.raises(InvalidRequestError) as info:
        to_spec(request_id)
    assert str(info.value) == (
        f"request_id has a control or format character ({code_point} at character {position}); "
        "ids may hold printable characters only"
    )
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("request_id", ["req-42", "a b:c/d=e", "zählung-7", "日本語-id"])
def test_a_printable_request_id_is_kept_in_the_tenant_s_namespace(request_id):
    acme = Tenant("acme")
    spec = to_spec(request_id, acme)
    assert spec.req_id == f"acme {request_id}"
    assert client_request_id(acme, spec.req_id) == request_id


def test_a_request_id_too_long_is_still_refused_first():
    with pytest.raises(InvalidRequestError, match="request_id is longer than 256 characters"):
        to_spec("\n" * 257)
