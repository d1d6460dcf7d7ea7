"""``kvserve generate``: stream one completion from a running server (``kvserve.client``)."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from kvserve.cluster.cli_values import check_utf8
from kvserve.cluster.host_port import check_grpc_target
from kvserve.scheduler.logprobs import TokenLogprobs
from kvserve.scheduler.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, MAX_PENALTY

_PENALTY_RANGE = f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"

# The request's fields that the server's errors start with -> the arguments that set them.
_ARGUMENT_OF_FIELD = {
    "text": "PROMPT",
    "prompt": "PROMPT",
    "cache_salt": "--cache-salt",
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "seed": "--seed",
    "stop": "--stop",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "logit_bias": "--logit-bias",
    "min_tokens": "--min-tokens",
    "repetition_penalty": "--repetition-penalty",
    "prompt_logprobs": "--prompt-logprobs",
}
_SERVER_FLAG_OF_LIMIT = {
    "max_prompt_bytes": "the server's --max-prompt-bytes",
    "max_prompt_tokens": "the server's --max-prompt-tokens",
    "max_cache_salt_bytes": "the server's --max-cache-salt-bytes",
}
# Names that are only ever a field's or a limit's, wherever they stand in an error.
_NAMES_IN_ERRORS = re.compile(
    r"\b(max_tokens|top_p|top_k|cache_salt|presence_penalty|frequency_penalty|logit_bias|min_tokens|prompt_logprobs|"
    r"repetition_penalty|min_p|"
    + "|".join(_SERVER_FLAG_OF_LIMIT) + r")\b"
)


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="stream one completion from a running server",
        description=(
            "Send PROMPT to a kvserve server and print the completion as it streams in; the "
            "finish reason and the token usage follow on stderr (and the prompt's logprobs, asked for with "
            "--prompt-logprobs, come before it on stderr)."
        ),
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    parser.add_argument(
        "--target", default="127.0.0.1:50051", type=_target, metavar="HOST:PORT",
        help="server address, or any gRPC target such as unix:PATH (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens", type=_int32, default=None, metavar="N",
        help="tokens to generate at most (server default: 16)",
    )
    parser.add_argument(
        "--temperature", type=float, default=None, metavar="T",
        help="0 is greedy (server default: 1.0)",
    )
    parser.add_argument(
        "--top-p", type=float, default=None, metavar="P",
        help="nucleus sampling mass in (0, 1] (server default: 1.0)",
    )
    parser.add_argument(
        "--top-k", type=_int32, default=None, metavar="K",
        help="sample among the K likeliest tokens; -1 or 0 disables (server default)",
    )
    parser.add_argument(
        "--min-p", type=float, default=None, metavar="P",
        help="sample only the tokens at least P, in [0, 1], times as probable as the likeliest one, after "
        "--top-k and --top-p (vLLM's; server default: 0, none)",
    )
    parser.add_argument("--seed", type=_int64, default=None, help="seed for reproducible sampling")
    parser.add_argument(
        "--presence-penalty", type=float, default=None, metavar="P",
        help=f"subtract P, in {_PENALTY_RANGE}, from the logit of every token the completion has generated "
        "(server default: 0)",
    )
    parser.add_argument(
        "--frequency-penalty", type=float, default=None, metavar="F",
        help=f"subtract F, in {_PENALTY_RANGE}, from a token's logit once for each time the completion "
        "generated it (server default: 0)",
    )
    parser.add_argument(
        "--repetition-penalty", type=float, default=None, metavar="R",
        help="divide the positive logits, and multiply the negative ones, of every token in the prompt or the "
        "completion so far by R > 0 (vLLM's; above 1 discourages repeats, below 1 encourages them; server "
        "default: 1, none)",
    )
    parser.add_argument(
        "--logit-bias", type=_logit_bias, action="append", default=None, metavar="TOKEN_ID=BIAS",
        help=f"add BIAS, in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], to the logit of token TOKEN_ID "
        f"(-{MAX_LOGIT_BIAS:g} in effect bans it); repeatable, up to {MAX_LOGIT_BIAS_TOKENS} tokens",
    )
    parser.add_argument(
        "--min-tokens", type=_int32, default=None, metavar="N",
        help="generate at least N tokens (at most --max-tokens): until then no stop token, end-of-sequence "
        "token or --stop string ends the completion (server default: 0)",
    )
    parser.add_argument(
        "--prompt-logprobs", type=_int32, default=None, metavar="K",
        help=f"print on stderr, before the completion, each prompt token's log-probability given the tokens "
        f"before it and the K (at most {MAX_LOGPROBS}) likeliest token ids at its position with theirs",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true",
        help="keep generating past the end-of-sequence token",
    )
    parser.add_argument(
        "--stop", action="append", default=None, metavar="TEXT",
        help="end the completion where its text contains TEXT (not printed); repeatable",
    )
    parser.add_argument(
        "--cache-salt", default="",
        help="share cached prefixes only with requests of the same salt",
    )
    parser.add_argument(
        "--auth-token-file", type=Path, default=None, metavar="FILE",
        help="send the first token of FILE as 'authorization: Bearer <token>' (the server's file format)",
    )
    parser.add_argument(
        "--tls-ca", type=Path, default=None, metavar="FILE",
        help="connect with TLS, trusting the server certificate's PEM CA in FILE",
    )
    parser.add_argument(
        "--tls-cert", type=Path, default=None, metavar="FILE",
        help="connect with TLS, presenting this PEM client certificate (for a server started with "
        "--tls-client-ca); needs --tls-key",
    )
    parser.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="the PEM private key of --tls-cert")
    parser.add_argument(
        "--timeout", type=_positive_seconds, default=60.0, metavar="S",
        help="deadline of the call in seconds (default: %(default)s)",
    )
    parser.set_defaults(handler=run_generate)


def _first_token(path: Path | None) -> str | None:
    """The first token of an auth token file, read as the server reads it (``ValueError`` naming the flag)."""
    if path is None:
        return None
    from kvserve.cluster.auth import read_token_file

    try:
        return read_token_file(path)[0].token
    except ValueError as exc:
        raise ValueError(f"--auth-token-file: {exc}") from None


def _tls_ca(path: Path | None) -> Path | None:
    """``--tls-ca``'s file, checked to be readable and to hold a PEM certificate."""
    if path is not None:
        from kvserve.cluster.tls import check_ca_file

        check_ca_file(path, name="--tls-ca")
    return path


def _check_client_certificate(cert: Path | None, key: Path | None) -> None:
    """``--tls-cert`` and ``--tls-key``: both or neither, readable PEM files, the key the certificate's."""
    if cert is None and key is None:
        return
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together")
    from kvserve.cluster.tls import check_key_pair

    check_key_pair(cert, key, cert_name="--tls-cert", key_name="--tls-key")


def _target(text: str) -> str:
    """A gRPC target: ``HOST:PORT`` checked, one with a resolver's scheme passed on as is."""
    try:
        return check_grpc_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds(text: str) -> float:
    """A deadline: 0 or less expired before the call could start (grpc said only DEADLINE_EXCEEDED)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return seconds


def _int32(text: str) -> int:
    """An integer of an ``int32`` field (``max_tokens``, ``top_k``); protobuf raised past its range."""
    return _integer_in_range(text, 32)


def _int64(text: str) -> int:
    """An integer of an ``int64`` field (``seed``)."""
    return _integer_in_range(text, 64)


def _logit_bias(text: str) -> tuple[int, float]:
    """``TOKEN_ID=BIAS`` as ``(token_id, bias)``; the server checks the id against its vocabulary, and the bias."""
    token_id, equals, bias = text.partition("=")
    expected = f"expected TOKEN_ID=BIAS such as 50256=-100, got {text!r}"
    if not equals or not (token_id.isascii() and token_id.isdigit()):
        raise argparse.ArgumentTypeError(expected)
    try:
        return _integer_in_range(token_id, 64), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(expected) from None


def _logit_biases(pairs: list[tuple[int, float]] | None) -> dict[int, float] | None:
    """``--logit-bias``'s pairs as a mapping; ``ValueError`` for a token given twice."""
    if pairs is None:
        return None
    biases: dict[int, float] = {}
    for token_id, bias in pairs:
        if token_id in biases:
            raise ValueError(f"--logit-bias: token {token_id} is given twice")
        biases[token_id] = bias
    return biases


def _integer_in_range(text: str, bits: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        raise argparse.ArgumentTypeError(f"must be an integer from {low:,} to {high:,}, got {text}")
    return value


def run_generate(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except BrokenPipeError:
        # The channel is closed by then, which cancelled the call and freed the request on the server.
        from kvserve.cluster.interrupts import closed_stdout_status

        return closed_stdout_status()


def _generate(args: argparse.Namespace) -> int:
    from kvserve.cluster.client import Client, RequestError

    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
             "frequency_penalty", "min_tokens", "prompt_logprobs", "repetition_penalty")
    sampling = {name: getattr(args, name) for name in names}
    try:
        sampling["logit_bias"] = _logit_biases(args.logit_bias)
        texts = [("PROMPT", args.prompt), ("--target", args.target), ("--cache-salt", args.cache_salt)]
        for name, text in [*texts, *(("--stop", stop) for stop in args.stop or ())]:
            check_utf8(text, name)
        token = _first_token(args.auth_token_file)
        tls_ca = _tls_ca(args.tls_ca)
        _check_client_certificate(args.tls_cert, args.tls_key)
    except ValueError as exc:
        print(f"kvserve generate: error: {exc}", file=sys.stderr)
        return 2
    with Client(args.target, token=token, tls_ca=tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
        last = None
        printed = False  # any text on stdout, whose line an error or the end must finish
        try:
            for delta in client.stream(
                args.prompt, timeout=args.timeout, ignore_eos=args.ignore_eos, cache_salt=args.cache_salt, **sampling
            ):
                if delta.prompt_logprobs is not None:
                    print(prompt_logprobs_lines(delta.prompt_logprobs), file=sys.stderr)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                printed = printed or bool(delta.text)
                last = delta
        except RequestError as exc:
            if printed:
                print()
            message = in_argument_terms(exc.message) if exc.code == "INVALID_ARGUMENT" else exc.message
            print(f"kvserve generate: error: {exc.code}: {message}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print()
            return 130
    print()
    if last is not None and last.usage is not None:
        usage = last.usage
        print(
            f"[{last.finish_reason}] prompt {_tokens(usage.prompt_tokens)} ({usage.cached_prompt_tokens} cached), "
            f"completion {_tokens(usage.completion_tokens)}, replica {last.replica}",
            file=sys.stderr,
        )
    return 0


def prompt_logprobs_lines(prompt_logprobs: Sequence[TokenLogprobs | None]) -> str:
    """The prompt's logprobs, a line per prompt token: its logprob, then the likeliest token ids at its position
    with theirs.  Tokens are named by position and id: the server sends no texts, and the CLI has no tokenizer."""
    lines = []
    for position, logprobs in enumerate(prompt_logprobs):
        if logprobs is None:
            lines.append(f"prompt token {position}: no logprob (nothing comes before it)")
            continue
        line = f"prompt token {position}: {logprobs.logprob:.4f}"
        if logprobs.top_token_ids:
            likeliest = ", ".join(
                f"{token_id} {logprob:.4f}" for token_id, logprob in zip(logprobs.top_token_ids, logprobs.top_logprobs)
            )
            line += f" (likeliest there, by token id: {likeliest})"
        lines.append(line)
    return "\n".join(lines)


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def in_argument_terms(message: str) -> str:
    """A server's refusal with the request's field names as ``generate``'s arguments:
    ``sampling_params.top_p must be in (0, 1]`` -> ``--top-p must be in (0, 1]``."""
    message = message.replace("sampling_params.", "")
    field, space, rest = message.partition(" ")
    name = field.removesuffix(":")
    if name in _ARGUMENT_OF_FIELD:
        message = f"{_ARGUMENT_OF_FIELD[name]}{field[len(name):]}{space}{rest}"
    return _NAMES_IN_ERRORS.sub(
        lambda match: _SERVER_FLAG_OF_LIMIT.get(match[1]) or _ARGUMENT_OF_FIELD[match[1]], message
    )
