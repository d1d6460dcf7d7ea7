"""``kvserve serve`` and ``kvserve generate`` as a user runs them: separate processes, real gRPC."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvserve import cli
from kvserve.cli import main
from kvserve.worker.tiny_model import create_tiny_model
from tests.cluster.serve_subprocess import COMMAND_TIMEOUT_S, STARTUP_TIMEOUT_S, ServeProcess, kvserve, serve_env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, int]]:
    # A fresh cache: `serve` creates the default model itself.
    process = ServeProcess(
        ["--port", "0", "--http-port", "0", "--num-blocks", "64"], serve_env(tmp_path_factory.mktemp("kvserve-cache"))
    )
    try:
        port = int(process.wait_for(r"listening on 127\.0\.0\.1:(\d+)", STARTUP_TIMEOUT_S).group(1))
        yield process, port
    finally:
        if process.proc.poll() is None:
            process.proc.kill()
            process.proc.wait()


def run_generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(kvserve("generate", *args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def test_serve_help_names_the_worker_resource_of_cpu_nodes(capsys):
    from kvserve.cluster.worker_actor import WORKER_CPU_RESOURCE

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    assert WORKER_CPU_RESOURCE in capsys.readouterr().out


def test_serve_help_gives_the_cpu_kv_cache_budget_the_worker_uses(capsys):
    # It said "as many as fit": on CPU the cache is a fixed budget.
    from kvserve.worker.worker_config import DEFAULT_CPU_KV_CACHE_BYTES

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert f"in {DEFAULT_CPU_KV_CACHE_BYTES // 2**20} MiB on CPU" in " ".join(capsys.readouterr().out.split())


def test_ctrl_c_before_a_command_handles_it_is_one_line(capsys, monkeypatch):
    # While modules load (serve's first seconds), Ctrl-C printed a KeyboardInterrupt traceback.
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["serve"]) == 130
    assert capsys.readouterr().err == "kvserve: interrupted\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "0"], "--tp must be a positive integer, got 0"),
        (["--simulated", "--num-blocks", "64", "--time-scale", "-1"], "--time-scale must be a finite number >= 0"),
        (["--replicas", "0"], "--replicas must be a positive integer, got 0"),
        (["--num-blocks", "1"], "--num-blocks must be an integer >= 2"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
        (["--cpu-threads", "0"], "--cpu-threads must be a positive integer, got 0"),
        (["--max-concurrent-requests-per-tenant", "2"],
         "--max-concurrent-requests-per-tenant needs an auth token file (--auth-token-file): its tokens are the tenants"),
        (["--monitoring-tenant", "ops"], "--monitoring-tenant needs an auth token file (--auth-token-file): its tokens"),
        (["--tenant-cache-share", "0.5"], "--tenant-cache-share needs an auth token file (--auth-token-file)"),
        # Each was silently ignored.
        (["--num-blocks", "64", "--cpu-kv-cache-bytes", "1000"],
         "--num-blocks sets the KV cache's size, which --cpu-kv-cache-bytes would set otherwise: give one of them"),
        (["--num-blocks", "64", "--gpu-memory-utilization", "0.5"], "which --gpu-memory-utilization would set"),
        (["--long-prefill-token-threshold", "0"], "--long-prefill-token-threshold must be a positive integer, got 0"),
        (["--stream-interval", "-1"], "--stream-interval must be in [0, 1] seconds"),
        (["--placement-timeout", "-1"], "--placement-timeout must be a positive number of seconds, got -1.0"),
        (["--step-timeout", "0"], "--step-timeout must be a positive number of seconds, got 0.0"),
        (["--step-timeout", "inf"], "--step-timeout must be a positive number of seconds, got inf"),
        (["--max-queue-wait", "-1"], "--max-queue-wait must be a finite number of seconds >= 0 (0: no wait), got -1.0"),
        (["--max-queue-wait", "inf"], "--max-queue-wait must be a finite number of seconds >= 0 (0: no wait), got inf"),
        (["--port", "70000"], "port"),
        (["--max-messages-per-s", "-1"], "--max-messages-per-s must be >= 0 (0: no budget), got -1"),
        (["--address", "head-node"], "expected 'auto' or HOST:PORT"),
        # Accepted before, and gRPC's OverflowError ended the server once it had started.
        (["--max-message-bytes", "2147483648"], "--max-message-bytes must be at most 2147483647 (gRPC's limit)"),
        # Accepted before, and sampled as --seed 0 does (the sampler keeps the low 64 bits).
        (["--seed", str(2**64)], "--seed must be a 64-bit signed integer (-9223372036854775808 to"),
        (["--model", "/nonexistent/model"], "config.json"),
        (["--time-scale", "2", "--model", "/nonexistent/model"], "error: --time-scale needs --simulated"),
        (["--cost-model", "x.json", "--time-scale", "2"], "error: --cost-model and --time-scale need --simulated"),
        (["--simulated", "--model", "/nonexistent/model"], "--num-blocks is required with simulation"),
        (
            ["--simulated", "--num-blocks", "64", "--cost-model", "/nonexistent/cost.json",
             "--model", "/nonexistent/model"],
            "--cost-model",
        ),
    ],
)
def test_serve_rejects_a_bad_setting_before_starting_anything(capsys, args, message):
    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--routing-arg", "foo=1"],
            "--routing-arg foo: the routing policy cost_ttft has no argument 'foo'; it takes cost_model=None, "
            "max_num_batched_tokens=None, tie_tolerance_steps=0.5, load_factor=2.0, load_slack=8",
        ),
        (
            ["--routing", "round_robin", "--routing-arg", "seed=1"],
            "--routing-arg seed: the routing policy round_robin has no argument 'seed'; it takes no arguments",
        ),
        (
            ["--routing", "cache_aware", "--routing-arg", "cache_threshold=2"],
            "--routing-arg: cache_threshold must be a finite number >= 0 and <= 1, got 2",
        ),
        (
            # Inherited by cost_ttft from the engine: it named --routing-arg, which nobody gave.
            ["--routing", "cost_ttft", "--max-num-batched-tokens", "1"],
            "--max-num-batched-tokens: the routing policy cost_ttft prices steps of this budget: "
            "max_num_batched_tokens must be an integer >= 2, got 1",
        ),
    ],
)
def test_a_bad_routing_arg_names_the_flag_and_the_policys_arguments(capsys, args, message):
    # It said "routing_args: bad arguments for routing policy 'cost_ttft': CostTTFTPolicy.__init__() got an
    # unexpected keyword argument 'foo'".
    assert main(["serve", *args]) == 2
    assert capsys.readouterr().err == f"kvserve serve: error: {message}\n"


@pytest.mark.parametrize(("flag", "value"), [("--host", "\udcff"), ("--address", "\udcff:6379")])
def test_serve_refuses_an_address_that_is_not_utf8_naming_the_flag(capsys, flag, value):
    # --host printed a UnicodeError traceback from getaddrinfo.
    assert main(["serve", flag, value]) == 2
    assert capsys.readouterr().err == f"kvserve serve: error: {flag} is not valid UTF-8 text (byte 0xff at offset 0)\n"


def test_serve_help_gives_the_shortest_auth_token_the_server_accepts(capsys, tmp_path):
    from kvserve.cluster.auth import MIN_TOKEN_CHARS, TokenTable

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert f"each token at least {MIN_TOKEN_CHARS} characters long" in " ".join(capsys.readouterr().out.split())
    path = tmp_path / "tokens"
    path.write_text("a" * MIN_TOKEN_CHARS + "\n")
    assert len(TokenTable.from_file(path)) == 1
    path.write_text("a" * (MIN_TOKEN_CHARS - 1) + "\n")
    with pytest.raises(ValueError, match=f"at least {MIN_TOKEN_CHARS} characters"):
        TokenTable.from_file(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("cli-model"), "llama", seed=0)


@pytest.mark.parametrize("host, message", [("127.0.0.1", "already in use"), ("no-such-host.invalid", "")])
def test_serve_refuses_an_address_it_cannot_listen_on_before_starting_ray(capsys, model_dir, host, message):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(model_dir), "--host", host, "--port", str(port)]) == 1
    captured = capsys.readouterr()
    assert f"cannot listen on {host}:{port}" in captured.err
    assert message in captured.err
    assert "Ray" not in captured.out


def test_serve_refuses_a_taken_http_port_before_starting_ray(capsys, model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(model_dir), "--port", "0", "--http-port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port} for HTTP: Address already in use" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--http-port", "70000"], "--http-port must be in [0, 65535] or None (no HTTP server), got 70000"),
        (["--port", "9000", "--http-port", "9000"], "--http-port must differ from the gRPC server's port, both are 9000"),
    ],
)
def test_serve_rejects_a_bad_http_port_before_starting_anything(capsys, model_dir, args, message):
    assert main(["serve", "--model", str(model_dir), *args]) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_token_budget_below_the_models_length_without_chunked_prefill_before_starting(
    capsys, model_dir
):
    # Refused by the scheduler actor before, once Ray and the replica had started, in a traceback.
    assert main(["serve", "--model", str(model_dir), "--no-chunked-prefill", "--max-num-batched-tokens", "512"]) == 2
    assert capsys.readouterr().err == (
        "kvserve serve: error: --max-num-batched-tokens must be >= --max-model-len when chunked prefill is off "
        "(got 512 < 2048): a long prompt could never be scheduled\n"
    )


def test_serve_names_the_switch_that_turned_chunked_prefill_off(capsys, model_dir):
    argv = ["serve", "--model", str(model_dir), "--no-chunked-prefill", "--long-prefill-token-threshold", "8"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "kvserve serve: error: --long-prefill-token-threshold needs chunked prefill, which --no-chunked-prefill "
        "turns off\n"
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file or directory"),
        ("  \n", "the file is empty"),
        # Accepted before, and then every chat request got a 400 blaming its messages.
        ("{% for m in messages %}{{ m.content }}\n{% endfor", "the chat template does not compile: line 2: "),
    ],
)
def test_serve_refuses_an_unusable_chat_template_before_starting(capsys, tmp_path, model_dir, content, message):
    path = tmp_path / "chat.jinja"
    if content is not None:
        path.write_text(content)
    assert main(["serve", "--model", str(model_dir), "--port", "0", "--chat-template", str(path)]) == 2
    assert f"--chat-template {path}: {message}" in capsys.readouterr().err


def test_no_http_turns_the_http_api_off():
    from kvserve.cli import build_parser

    assert build_parser().parse_args(["serve", "--no-http"]).http_port is None
    assert build_parser().parse_args(["serve"]).http_port == 8000


def test_serve_refuses_a_tp_that_cannot_split_the_model_before_starting_ray(capsys, model_dir):
    # Each replica's workers found out a minute later, after Ray and the actors had started.
    assert main(["serve", "--model", str(model_dir), "--port", "0", "--tp", "3"]) == 2
    captured = capsys.readouterr()
    assert f"--tp 3 cannot split the model in {model_dir}: it must divide the 4 attention heads" in captured.err
    assert "Ray" not in captured.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_serve_on_cuda_without_a_gpu_says_so_at_once(capsys, model_dir):
    # It waited out the 60 s placement timeout of each replica before saying anything.
    start = time.monotonic()
    assert main(["serve", "--model", str(model_dir), "--port", "0", "--http-port", "0", "--device", "cuda", "--replicas", "2"]) == 1
    assert time.monotonic() - start < 10.0
    captured = capsys.readouterr()
    assert "--device cuda needs 2 GPU(s) (2 replica(s) x TP 1), and this machine has 0" in captured.err
    assert "Ray" not in captured.out


@pytest.mark.parametrize("device", [[], ["--device", "cpu"]])
def test_serve_with_the_cuda_attention_backend_on_cpu_says_so_at_once(capsys, model_dir, device):
    # It started Ray and the replica, and failed 20 s later with the kernel's words, naming no flag.
    if not device and torch.cuda.is_available():
        pytest.skip("checks a machine without a GPU")
    args = ["serve", "--model", str(model_dir), "--port", "0", "--http-port", "0", "--attention-backend", "cuda"]
    assert main([*args, *device]) == 1
    captured = capsys.readouterr()
    assert "--attention-backend cuda needs the replicas on a GPU, and they run on CPU here" in captured.err
    assert "Ray" not in captured.out


def test_generate_without_a_server_says_unavailable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens here once the socket closes
    result = run_generate("--target", f"127.0.0.1:{port}", "--timeout", "5", "hello")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_refuses_a_port_out_of_range(capsys):
    # 99999 wrapped around to port 34463 in grpc and reached whatever listened there.
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", "127.0.0.1:99999", "hello"])
    assert exit_info.value.code == 2
    assert "expected HOST:PORT with a port in 1..65535, got '127.0.0.1:99999'" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://127.0.0.1:50051", "https://example.com:443", "grpc://127.0.0.1:50051"])
def test_generate_refuses_a_url_as_its_target_naming_the_argument(capsys, url):
    # A URL's host ("http://127.0.0.1") passed the HOST:PORT check; Client refused it later, in a traceback.
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", url, "hello"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --target: expected the server's HOST:PORT, not a URL: got '{url}'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("timeout", "message"),
    [
        ("0", "must be a positive number of seconds, got '0'"),
        ("-1", "must be a positive number of seconds, got '-1'"),
        ("nan", "must be a positive number of seconds, got 'nan'"),
        ("inf", "must be a positive number of seconds, got 'inf'"),
        ("soon", "expected a number of seconds, got 'soon'"),
    ],
)
def test_generate_refuses_a_timeout_that_is_not_a_positive_number(capsys, timeout, message):
    # A deadline of 0 expired before the call started: grpc said only DEADLINE_EXCEEDED.
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--timeout", timeout, "hello"])
    assert exit_info.value.code == 2
    assert f"argument --timeout: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-tokens", "99999999999", "must be an integer from -2,147,483,648 to 2,147,483,647, got 99999999999"),
        ("--top-k", "-3000000000", "must be an integer from -2,147,483,648 to 2,147,483,647"),
        ("--seed", "99999999999999999999", "must be an integer from -9,223,372,036,854,775,808 to"),
        ("--max-tokens", "many", "expected an integer, got 'many'"),
    ],
)
def test_generate_refuses_a_number_its_field_cannot_hold(capsys, flag, value, message):
    # protobuf raised "ValueError: Value out of range" from setattr: a traceback.
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", flag, value, "hello"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_serve_says_at_once_when_no_ray_cluster_is_at_the_address(capsys, model_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens here once the socket closes
    start = time.monotonic()
    # ray.init itself retried for over 3 minutes.
    assert main(["serve", "--model", str(model_dir), "--port", "0", "--address", f"127.0.0.1:{port}"]) == 1
    assert time.monotonic() - start < 30.0
    assert f"no Ray cluster at 127.0.0.1:{port}: Connection refused" in capsys.readouterr().err


def test_serve_shows_its_progress_while_starting(server):
    process, _ = server
    output = "".join(process.lines)
    assert "creating the default tiny model" in output
    assert "started a local Ray instance" in output
    assert "replica 0 ready" in output


def test_serve_answers_the_openai_api_on_its_http_port(server):
    import httpx

    process, _ = server
    printed = "".join(process.lines)
    http_port = int(re.search(r"OpenAI-compatible API at http://127\.0\.0\.1:(\d+)/v1", printed).group(1))
    base_url = f"http://127.0.0.1:{http_port}"
    model = httpx.get(f"{base_url}/v1/models", timeout=COMMAND_TIMEOUT_S).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=COMMAND_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{base_url}/health", timeout=COMMAND_TIMEOUT_S).status_code == 200


def test_generate_streams_the_completion_and_prints_the_usage(server):
    _, port = server
    result = run_generate(
        "--target", f"127.0.0.1:{port}", "--max-tokens", "8", "--temperature", "0", "--ignore-eos", "hello world"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "[length]" in result.stderr
    assert "completion 8 tokens" in result.stderr


def test_generate_stops_at_a_stop_string_without_printing_it(server):
    _, port = server
    args = ("--target", f"127.0.0.1:{port}", "--max-tokens", "24", "--temperature", "0", "--ignore-eos", "stop me")
    whole = run_generate(*args).stdout.removesuffix("\n")
    stop = whole[len(whole) // 2 :][:3]

    result = run_generate(*args, "--stop", stop)

    assert result.returncode == 0, result.stderr
    assert result.stdout == whole[: whole.index(stop)] + "\n"
    assert "[stop]" in result.stderr


def test_generate_reports_invalid_input_without_a_traceback(server):
    _, port = server
    result = run_generate("--target", f"127.0.0.1:{port}", "--top-p", "2", "hello")
    assert result.returncode == 1
    assert result.stderr == "kvserve generate: error: INVALID_ARGUMENT: --top-p must be in (0, 1], got 2.0\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([""], "PROMPT is empty"),
        (["hello", "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
        (["hello", "--stop", ""], "--stop: a stop string is empty"),
    ],
)
def test_generate_names_its_own_arguments_in_the_servers_refusals(server, args, message):
    # They named the gRPC fields: "text is empty", "sampling_params.max_tokens must be ...".
    _, port = server
    result = run_generate("--target", f"127.0.0.1:{port}", *args)
    assert result.returncode == 1
    assert result.stderr == f"kvserve generate: error: INVALID_ARGUMENT: {message}\n"
    assert result.stdout == ""


def test_generate_counts_a_single_token_in_the_singular(server):
    _, port = server
    result = run_generate("--target", f"127.0.0.1:{port}", "--max-tokens", "1", "--ignore-eos", "hello")
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"\[length\] prompt \d+ tokens? \(\d+ cached\), completion 1 token, replica 0\n", result.stderr)


def test_generate_into_a_closed_pipe_exits_as_sigpipe_without_a_traceback(server):
    # `kvserve generate ... | head -c 5` printed a BrokenPipeError traceback.
    _, port = server
    proc = subprocess.Popen(
        kvserve("generate", "--target", f"127.0.0.1:{port}", "--max-tokens", "8", "--ignore-eos", "hello"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    proc.stdout.close()  # before the first token: its write finds no reader
    stderr = proc.stderr.read()
    assert proc.wait(timeout=COMMAND_TIMEOUT_S) == 128 + signal.SIGPIPE
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_serve_stops_cleanly_on_sigterm(server):
    process, _ = server
    process.proc.send_signal(signal.SIGTERM)
    assert process.proc.wait(timeout=COMMAND_TIMEOUT_S) == 0
    output = process.output()
    assert "stopped" in output
    assert "Traceback" not in output


def test_every_engine_setting_has_a_serve_flag_that_sets_it(tmp_path):
    # dtype, seed, the cache's sizing, prefix caching, chunked prefill, the attention kernels and the CPU
    # threads could be set in-process (LLM(...)) but had no flag and no config-file key.
    from kvserve.cli import build_parser
    from kvserve.cluster.cli_serve_engine import engine_config
    from kvserve.scheduler.engine_config import EngineConfig

    args = build_parser().parse_args([
        "serve", "--dtype", "float16", "--seed", "7", "--gpu-memory-utilization", "0.5",
        "--cpu-kv-cache-bytes", "1048576", "--no-prefix-caching", "--long-prefill-token-threshold", "64",
        "--attention-backend", "torch", "--cpu-threads", "3", "--tp", "2", "--replicas", "3",
    ])
    config = engine_config(args, tmp_path)
    assert (config.runtime.dtype, config.runtime.seed, config.runtime.attention_backend) == ("float16", 7, "torch")
    assert config.runtime.cpu_threads == 3
    assert (config.cache.gpu_memory_utilization, config.cache.cpu_kv_cache_bytes) == (0.5, 1 << 20)
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.long_prefill_token_threshold == 64
    assert (config.parallel.tensor_parallel_size, config.parallel.num_replicas) == (2, 3)
    whole_prompts = ["serve", "--no-chunked-prefill", "--max-num-batched-tokens", "4096", "--max-model-len", "4096"]
    assert engine_config(build_parser().parse_args(whole_prompts), tmp_path).scheduler.enable_chunked_prefill is False
    flagged = {action.dest for action in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert set(EngineConfig.field_names()) - {"model"} <= flagged
    assert engine_config(build_parser().parse_args(["serve"]), tmp_path) == EngineConfig(str(tmp_path))


def test_placement_waits_without_limit_when_joining_a_cluster_unless_told():
    from kvserve.cli import build_parser
    from kvserve.cluster.cli_serve import _placement_timeout

    parse = build_parser().parse_args
    assert _placement_timeout(parse(["serve"])) == 60.0
    assert _placement_timeout(parse(["serve", "--address", "auto"])) is None
    assert _placement_timeout(parse(["serve", "--address", "auto", "--placement-timeout", "900"])) == 900.0


# -- conveniences ------------------------------------------------------------------


def test_version_prints_the_installed_version(capsys):
    from tests.toml_reader import tomllib

    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as file:
        version = tomllib.load(file)["project"]["version"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"kvserve {version}\n"


@pytest.mark.parametrize(
    "argv, level",
    [
        (["serve"], logging.WARNING),
        (["-v", "serve"], logging.DEBUG),
        (["serve", "-v"], logging.DEBUG),
        (["serve", "--verbose"], logging.DEBUG),
        (["--log-level", "error", "serve"], logging.ERROR),
        (["serve", "--log-level", "info"], logging.INFO),
        (["serve", "--log-level", "DEBUG"], logging.DEBUG),
        (["generate", "hello", "--log-level", "critical"], logging.CRITICAL),
        (["experiment", "--log-level", "info", "--workload", "w", "--qps", "1", "--out", "o"], logging.INFO),
        # The level named wins over -v, wherever each is.
        (["-v", "serve", "--log-level", "error"], logging.ERROR),
        (["--log-level", "info", "serve", "-v"], logging.INFO),
    ],
)
def test_verbosity_is_accepted_before_and_after_the_subcommand(argv, level):
    from kvserve.cli import build_parser, log_level

    assert log_level(build_parser().parse_args(argv)) == level


def test_an_unknown_log_level_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--log-level", "loud"])
    assert exit_info.value.code == 2
    assert "argument --log-level: invalid choice: 'loud' (choose from 'debug', 'info'" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "logged"), [([], False), (["--log-level", "info"], True), (["-v"], True)])
def test_the_log_level_after_the_subcommand_sets_what_is_logged(tmp_path, flags, logged):
    result = subprocess.run(
        kvserve("create-tiny-model", str(tmp_path / "model"), *flags),
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert ("INFO kvserve.worker.tiny_model: created tiny llama model" in result.stderr) == logged


def test_serve_help_spells_out_the_defaults_of_modules_it_does_not_import() -> None:
    from kvserve.cluster import cli_serve, cli_serve_engine
    from kvserve.cluster.config import DEFAULT_MAX_MESSAGE_BYTES
    from kvserve.cluster.worker_actor import WORKER_CPU_RESOURCE
    from kvserve.worker.worker_config import DEFAULT_CPU_KV_CACHE_BYTES

    assert cli_serve._MAX_MESSAGE_BYTES == DEFAULT_MAX_MESSAGE_BYTES
    assert cli_serve._WORKER_CPU_RESOURCE == WORKER_CPU_RESOURCE
    assert cli_serve_engine.CPU_KV_CACHE_MIB * 2**20 == DEFAULT_CPU_KV_CACHE_BYTES


def test_a_workers_kv_cache_budget_error_reaches_serves_user_in_flag_terms():
    # The worker's message, as `serve` prints it after "the cluster failed to start: ...".
    import torch

    from kvserve.cli import build_parser
    from kvserve.worker.kv_cache import KVCacheSpec, num_blocks_for_budget

    args = build_parser().parse_args(["serve"])
    spec = KVCacheSpec(num_layers=2, block_size=16, num_local_kv_heads=2, head_dim=16, dtype=torch.float32)
    for setting, flag in [("cpu_kv_cache_bytes is 1", "--cpu-kv-cache-bytes is 1"),
                          ("gpu_memory_utilization is 0.1", "--gpu-memory-utilization is 0.1")]:
        with pytest.raises(ValueError) as info:
            num_blocks_for_budget(spec, 1, setting)
        failed = RuntimeError(f"replica 0 rank 0 failed at DetermineNumBlocks: INTERNAL: SettingError: {info.value}")
        assert args.flag_terms.message(failed) == (
            f"replica 0 rank 0 failed at DetermineNumBlocks: INTERNAL: SettingError: {flag}: this rank's KV cache "
            "gets 1 bytes, 0 blocks of 8192 bytes; at least 2 blocks (16384 bytes) are needed"
        )
