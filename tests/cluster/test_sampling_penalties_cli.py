"""``kvserve generate``'s ``--presence-penalty``, ``--frequency-penalty``, ``--logit-bias TOKEN_ID=BIAS``,
``--min-tokens`` and ``--repetition-penalty``: what they send, how a bad one is refused, and the server's refusals in their terms.

A stand-in gRPC server records the request it is sent and streams one token back.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvserve.cli import main
from kvserve.cluster.cli_generate import in_argument_terms
from kvserve.proto import generate_pb2, generate_pb2_grpc


class RecordingGeneration(generate_pb2_grpc.GenerationServicer):
    """Records each request, and answers it with one token."""

    def __init__(self) -> None:
        self.requests: list[generate_pb2.GenerateRequest] = []

    def Generate(self, request, context):  # noqa: N802 - the gRPC method's name
        self.requests.append(request)
        usage = generate_pb2.Usage(prompt_tokens=1, completion_tokens=1, cached_prompt_tokens=0)
        yield generate_pb2.GenerateResponse(
            request_id="r", text="Hello", token_ids=[7], replica=0,
            finish_reason=generate_pb2.FINISH_REASON_LENGTH, usage=usage,
        )


@pytest.fixture(scope="module")
def servicer() -> Iterator[RecordingGeneration]:
    servicer = RecordingGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    servicer.target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield servicer
    server.stop(grace=None)


def sent(servicer: RecordingGeneration, *args: str) -> generate_pb2.SamplingParams:
    """The sampling parameters ``generate hi ARGS`` sends."""
    servicer.requests.clear()
    assert main(["generate", "--timeout", "10", "--target", servicer.target, "hi", *args]) == 0
    [request] = servicer.requests
    return request.sampling_params


def test_each_flag_is_sent_in_its_field(servicer):
    params = sent(
        servicer, "--presence-penalty", "0.5", "--frequency-penalty", "-1.25", "--min-tokens", "3",
        "--logit-bias", "50256=-100", "--logit-bias", "7=2.5", "--repetition-penalty", "1.3",
    )

    assert (params.presence_penalty, params.frequency_penalty, params.min_tokens) == (0.5, -1.25, 3)
    assert params.repetition_penalty == 1.3
    assert dict(params.logit_bias) == {50256: -100.0, 7: 2.5}


def test_without_the_flags_the_fields_stay_unset_for_the_servers_defaults(servicer):
    params = sent(servicer)

    assert not any(params.HasField(name) for name in ("presence_penalty", "frequency_penalty", "min_tokens",
                                                      "repetition_penalty"))
    assert not params.logit_bias


@pytest.mark.parametrize("value", ["abc", "5", "=1", "x=1", "-1=3", "+5=1", "5=", "5=high", "5=1=2"])
def test_a_logit_bias_that_is_not_token_id_equals_bias_is_refused_naming_the_flag(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", f"--logit-bias={value}"])  # "-1=3" as a separate word would read as a flag

    assert exit_info.value.code == 2
    assert f"argument --logit-bias: expected TOKEN_ID=BIAS such as 50256=-100, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--min-tokens", "2.5", "expected an integer, got '2.5'"),
        ("--min-tokens", str(2**31), "must be an integer from -2,147,483,648 to 2,147,483,647"),
        ("--presence-penalty", "high", "invalid float value: 'high'"),
        ("--frequency-penalty", "", "invalid float value: ''"),
        ("--repetition-penalty", "strong", "invalid float value: 'strong'"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_the_flag(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", flag, value])

    assert exit_info.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_a_token_biased_twice_is_one_line_naming_the_flag(capsys, servicer):
    servicer.requests.clear()

    assert main(["generate", "--target", servicer.target, "hi", "--logit-bias", "5=1", "--logit-bias", "5=2"]) == 2
    assert capsys.readouterr().err == "kvserve generate: error: --logit-bias: token 5 is given twice\n"
    assert not servicer.requests


@pytest.mark.parametrize(
    ("server_message", "message"),
    [
        ("sampling_params.presence_penalty must be in [-2, 2], got 3.0",
         "--presence-penalty must be in [-2, 2], got 3.0"),
        ("sampling_params.frequency_penalty must be in [-2, 2], got nan",
         "--frequency-penalty must be in [-2, 2], got nan"),
        ("sampling_params.logit_bias: token id 50256 is outside the vocabulary [0, 32000)",
         "--logit-bias: token id 50256 is outside the vocabulary [0, 32000)"),
        ("sampling_params.logit_bias[5] must be in [-100, 100], got 200.0",
         "--logit-bias[5] must be in [-100, 100], got 200.0"),
        ("sampling_params.logit_bias may name at most 300 tokens, got 301",
         "--logit-bias may name at most 300 tokens, got 301"),
        ("sampling_params.min_tokens must be in [0, max_tokens=16], got 20",
         "--min-tokens must be in [0, --max-tokens=16], got 20"),
        ("sampling_params.repetition_penalty must be finite and > 0, got 0.0",
         "--repetition-penalty must be finite and > 0, got 0.0"),
    ],
)
def test_a_refusal_of_the_new_fields_names_the_flags(server_message, message):
    assert in_argument_terms(server_message) == message


def test_the_help_gives_each_flags_range(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())

    assert "--presence-penalty P subtract P, in [-2, 2]," in help_text
    assert "--frequency-penalty F subtract F, in [-2, 2]," in help_text
    assert "--logit-bias TOKEN_ID=BIAS add BIAS, in [-100, 100], to the logit of token TOKEN_ID" in help_text
    assert "repeatable, up to 300 tokens" in help_text
    assert "--min-tokens N generate at least N tokens (at most --max-tokens)" in help_text
    assert "--repetition-penalty R divide the positive logits, and multiply the negative ones, of every token in the " \
        "prompt or the completion so far by R > 0" in help_text
