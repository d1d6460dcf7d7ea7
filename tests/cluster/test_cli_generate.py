"""``kvserve generate``'s own messages: its arguments checked before any call, and what it
prints of a call, against a stand-in gRPC server that answers as a kvserve server does."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvserve.cli import main
from kvserve.cluster.cli_generate import in_argument_terms
from kvserve.proto import generate_pb2, generate_pb2_grpc

# What the stand-in server does with a prompt: anything else streams "Hello" in one token.
REFUSED = "refused"
REFUSED_AFTER_TEXT = "refused after text"
REFUSAL = "sampling_params.max_tokens: 5 prompt tokens + max_tokens 16 (the default) exceed max_model_len 8"


# The stand-in's prompt logprobs, whatever the prompt: two entries (a prompt of three tokens), up to two
# alternatives each.
PROMPT_LOGPROBS = [
    generate_pb2.TokenLogprobs(logprob=-2.5, top_logprobs=[
        generate_pb2.TopLogprob(token_id=17, logprob=-0.5), generate_pb2.TopLogprob(token_id=4, logprob=-1.25),
    ]),
    generate_pb2.TokenLogprobs(logprob=-0.125, top_logprobs=[
        generate_pb2.TopLogprob(token_id=9, logprob=-0.125), generate_pb2.TopLogprob(token_id=3, logprob=-3.0),
    ]),
]


class StandInGeneration(generate_pb2_grpc.GenerationServicer):
    """A server that streams one token (with ``PROMPT_LOGPROBS``, as many alternatives as asked, when asked),
    or refuses as kvserve's front end does."""

    def Generate(self, request, context):  # noqa: N802 - the gRPC method's name
        if request.text == REFUSED_AFTER_TEXT:
            yield generate_pb2.GenerateResponse(request_id="r", text="Hel", token_ids=[7], replica=0)
        if request.text in (REFUSED, REFUSED_AFTER_TEXT):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, REFUSAL)
        usage = generate_pb2.Usage(prompt_tokens=1, completion_tokens=1, cached_prompt_tokens=0)
        response = generate_pb2.GenerateResponse(
            request_id="r", text="Hello", token_ids=[7], replica=0,
            finish_reason=generate_pb2.FINISH_REASON_LENGTH, usage=usage,
        )
        params = request.sampling_params
        if params.HasField("prompt_logprobs"):
            for logprobs in PROMPT_LOGPROBS:
                top = logprobs.top_logprobs[: params.prompt_logprobs]
                response.prompt_logprobs.append(generate_pb2.TokenLogprobs(logprob=logprobs.logprob, top_logprobs=top))
        yield response


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generate_pb2_grpc.add_GenerationServicer_to_server(StandInGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def generate(*args: str) -> int:
    return main(["generate", "--timeout", "10", *args])


def test_the_usage_line_says_1_token_not_1_tokens(capsys, target):
    assert generate("--target", target, "hi") == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello\n"
    assert captured.err == "[length] prompt 1 token (0 cached), completion 1 token, replica 0\n"


def test_prompt_logprobs_are_a_line_per_prompt_token_on_stderr_before_the_usage(capsys, target):
    assert generate("--target", target, "--prompt-logprobs", "2", "hi") == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello\n"
    assert captured.err == (
        "prompt token 0: no logprob (nothing comes before it)\n"
        "prompt token 1: -2.5000 (likeliest there, by token id: 17 -0.5000, 4 -1.2500)\n"
        "prompt token 2: -0.1250 (likeliest there, by token id: 9 -0.1250, 3 -3.0000)\n"
        "[length] prompt 1 token (0 cached), completion 1 token, replica 0\n"
    )


def test_prompt_logprobs_0_print_each_prompt_tokens_own_only(capsys, target):
    assert generate("--target", target, "--prompt-logprobs", "0", "hi") == 0
    assert capsys.readouterr().err.splitlines()[:3] == [
        "prompt token 0: no logprob (nothing comes before it)", "prompt token 1: -2.5000", "prompt token 2: -0.1250"
    ]


def test_an_error_before_any_text_is_one_line_without_a_blank_line_before_it(capsys, target):
    assert generate("--target", target, REFUSED) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "kvserve generate: error: INVALID_ARGUMENT: --max-tokens: 5 prompt tokens + --max-tokens 16 "
        "(the default) exceed max_model_len 8\n"
    )


def test_an_error_after_some_text_ends_the_texts_line_on_stdout(capsys, target):
    assert generate("--target", target, REFUSED_AFTER_TEXT) == 1
    captured = capsys.readouterr()
    assert captured.out == "Hel\n"
    assert captured.err.startswith("kvserve generate: error: INVALID_ARGUMENT: --max-tokens: ")


@pytest.mark.parametrize(
    ("server_message", "message"),
    [
        ("text is empty", "PROMPT is empty"),
        ("text: 201 bytes, over the limit of 200 (max_prompt_bytes)",
         "PROMPT: 201 bytes, over the limit of 200 (the server's --max-prompt-bytes)"),
        ("prompt: needs 40 KV blocks, more than a replica has", "PROMPT: needs 40 KV blocks, more than a replica has"),
        ("sampling_params.top_p must be in (0, 1], got 2.0", "--top-p must be in (0, 1], got 2.0"),
        ("sampling_params.top_k must be -1 (disabled) or >= 0, got -2",
         "--top-k must be -1 (disabled) or >= 0, got -2"),
        ("sampling_params.temperature must be finite and >= 0, got -1.0",
         "--temperature must be finite and >= 0, got -1.0"),
        ("sampling_params.stop: a stop string is empty", "--stop: a stop string is empty"),
        ("cache_salt: 300 bytes, over the limit of 256 (max_cache_salt_bytes)",
         "--cache-salt: 300 bytes, over the limit of 256 (the server's --max-cache-salt-bytes)"),
        ("request_id is longer than 64 characters", "request_id is longer than 64 characters"),
        ("sampling_params.prompt_logprobs must be an integer in [0, 20], got 21",
         "--prompt-logprobs must be an integer in [0, 20], got 21"),
        ("sampling_params.prompt_logprobs: this server's replicas are simulated (no model), so it has no "
         "log-probabilities",
         "--prompt-logprobs: this server's replicas are simulated (no model), so it has no log-probabilities"),
    ],
)
def test_a_refusal_names_generates_arguments_not_the_grpc_fields(server_message, message):
    assert in_argument_terms(server_message) == message


def test_a_refusal_in_words_keeps_its_words():
    # "prompt" and "stop" are names only where they lead the message.
    message = "the prompt has 2048 tokens; stop strings need a tokenizer"
    assert in_argument_terms(message) == message


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["\udcff\udcfe"], "PROMPT is not valid UTF-8 text (byte 0xff at offset 0)"),
        (["hi", "--cache-salt", "a\udcff"], "--cache-salt is not valid UTF-8 text (byte 0xff at offset 1)"),
        (["hi", "--stop", "ok", "--stop", "é\udcff"], "--stop is not valid UTF-8 text (byte 0xff at offset 2)"),
        (["hi", "--target", "unix:/tmp/\udcff"], "--target is not valid UTF-8 text (byte 0xff at offset 10)"),
    ],
)
def test_text_that_is_not_utf8_is_refused_naming_the_argument(capsys, args, message):
    assert generate(*args) == 2
    assert capsys.readouterr().err == f"kvserve generate: error: {message}\n"


def test_a_prompt_of_bytes_that_are_not_utf8_is_one_line_from_the_shell():
    # What a shell passes for $'\xff\xfe': it printed a UnicodeEncodeError traceback.
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", b"\xff\xfe"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == "kvserve generate: error: PROMPT is not valid UTF-8 text (byte 0xff at offset 0)\n"


@pytest.fixture
def ca_file(tmp_path: Path) -> Path:
    """A self-signed CA certificate (the client checks it as ``ssl`` loads it)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from tests.cluster.test_security import _certificate

    key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "ca.pem"
    path.write_bytes(_certificate("test CA", key, key.public_key(), "test CA", ca=True).public_bytes(
        serialization.Encoding.PEM))
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing.pem", "cannot read {path}: No such file or directory"),
        (lambda tmp: tmp, "cannot read {path}: Is a directory"),
        (lambda tmp: _unreadable(tmp / "secret.pem"), "cannot read {path}: Permission denied"),
        (lambda tmp: _written(tmp / "key.txt", "not a certificate\n"),
         "{path}: holds no certificate (expected PEM CA certificates)"),
    ],
)
def test_an_unusable_tls_ca_file_is_one_line_naming_the_flag(capsys, tmp_path, make, message):
    path = make(tmp_path)
    assert generate("hi", "--tls-ca", str(path)) == 2
    assert capsys.readouterr().err == f"kvserve generate: error: --tls-ca: {message.format(path=path)}\n"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp, "cannot read the auth token file {path}: Is a directory"),
        (lambda tmp: _unreadable(tmp / "tokens"), "cannot read the auth token file {path}: Permission denied"),
        (lambda tmp: _written(tmp / "tokens", "# none\n"),
         "the auth token file {path} holds no token (one per line: 'token' or 'token tenant-name')"),
        (lambda tmp: _written(tmp / "tokens", "tökentökentökentöken\n"),
         "{path}:1: the token has a character that a bearer token cannot hold (a non-ASCII character at "
         "character 2); allowed: A-Z a-z 0-9 - . _ ~ + / (then = padding)"),
    ],
)
def test_an_unusable_auth_token_file_is_one_line_naming_the_flag(capsys, tmp_path, make, message):
    path = make(tmp_path)
    assert generate("hi", "--auth-token-file", str(path)) == 2
    assert capsys.readouterr().err == f"kvserve generate: error: --auth-token-file: {message.format(path=path)}\n"


def test_a_readable_tls_ca_file_is_used_for_the_call(capsys, ca_file, target):
    # The stand-in server speaks no TLS: the call is made, and fails as a connection does.
    assert generate("--target", target, "--timeout", "5", "hi", "--tls-ca", str(ca_file)) == 1
    assert capsys.readouterr().err.startswith("kvserve generate: error: UNAVAILABLE: ")


def test_a_failed_tls_handshake_is_the_error_line_alone(ca_file, target):
    # gRPC's core wrote its own raw line about the handshake first ("I1129 ... Handshake failed ...").
    env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--target", target, "--timeout", "5", "hi",
         "--tls-ca", str(ca_file)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("kvserve generate: error: UNAVAILABLE: ") and "handshake" in line.lower()


def _written(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _unreadable(path: Path) -> Path:
    path.write_text("x")
    path.chmod(0)
    if _can_read(path):  # root reads it anyway
        pytest.skip("this user reads files whatever their mode")
    return path


def _can_read(path: Path) -> bool:
    try:
        path.read_bytes()
    except OSError:
        return False
    return True


TOKEN = "alice-token-0123456789"


@pytest.mark.parametrize(
    "text",
    [
        f"{TOKEN}\n",
        f"\ufeff{TOKEN} acme\r\n",  # a byte-order mark and CRLF: not part of the token
        f"# tenants\n  # {TOKEN}x\n{TOKEN}\t# a comment after whitespace\n",
        f"{TOKEN}#0123\n",  # it was cut at the '#' on both sides
        f"{TOKEN}\x00\n",
        f"{TOKEN}é\n",
        f"{TOKEN}\u00a0acme\n",
        f"{TOKEN} ac\x1bme\n",
        "short\n",
        f"{TOKEN}\n{TOKEN}\n",
    ],
)
def test_generate_takes_a_token_file_exactly_when_the_server_does(tmp_path, text):
    from kvserve.cluster.auth import TokenTable
    from kvserve.cluster.cli_generate import _first_token

    path = _written(tmp_path / "tokens", text)
    try:
        served = TokenTable.from_file(path).authenticate(f"Bearer {TOKEN}")
    except ValueError as exc:
        with pytest.raises(ValueError) as info:
            _first_token(path)
        assert str(info.value) == f"--auth-token-file: {exc}"
    else:
        assert served is not None and _first_token(path) == TOKEN
