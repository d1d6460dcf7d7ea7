"""The benchmarks refuse bad numbers and names as usage errors that name the flag, before any work."""

from __future__ import annotations

import argparse
import importlib

import pytest

from kvserve.bench.arg_types import float_above, int_at_least, positive_ints


@pytest.mark.parametrize(
    ("bench", "argv", "message"),
    [
        ("simulator_scale", ["--replicas", "0"], "argument --replicas: expected an integer >= 1, got '0'"),
        ("simulator_scale", ["--requests", "0"], "argument --requests: expected an integer >= 1, got '0'"),
        ("simulator_scale", ["--kv-blocks", "0"], "argument --kv-blocks: expected an integer >= 1, got '0'"),
        ("simulator_scale", ["--qps-per-replica", "0"], "argument --qps-per-replica: expected a finite number > 0"),
        ("simulator_scale", ["--output-len", "0"], "argument --output-len: expected an integer >= 1, got '0'"),
        ("simulator_scale", ["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
        ("scheduler_step", ["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
        ("scheduler_step", ["--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
        ("prefix_cache", ["--requests", "-1"], "argument --requests: expected an integer >= 1, got '-1'"),
        ("tenant_cache", ["--shares", "0.5,0"], "argument --shares: expected comma-separated numbers in (0, 1], got '0.5,0'"),
        ("tenant_cache", ["--shares", "1.5"], "argument --shares: expected comma-separated numbers in (0, 1], got '1.5'"),
        ("tenant_cache", ["--rates", "-1"], "argument --rates: expected comma-separated numbers >= 0, got '-1'"),
        ("tenant_cache", ["--rates", "nan"], "argument --rates: expected comma-separated numbers >= 0, got 'nan'"),
        ("tenant_cache", ["--duration", "0"], "argument --duration: expected a finite number > 0"),
        ("e2e_throughput", ["--num-requests", "0"], "argument --num-requests: expected an integer >= 1, got '0'"),
        ("e2e_throughput", ["--repeat", "0"], "argument --repeat: expected an integer >= 1, got '0'"),
        ("e2e_throughput", ["--threads", "0"], "argument --threads: expected an integer >= 1, got '0'"),
        ("e2e_throughput", ["--stream-intervals", "-1"], "argument --stream-intervals: expected a finite number > 0"),
        ("offline_throughput", ["--threads", "0"], "argument --threads: expected an integer >= 1, got '0'"),
        ("offline_throughput", ["--hf-batch-size", "0"], "argument --hf-batch-size: expected an integer >= 1"),
        ("decode_attention", ["--rounds", "0"], "argument --rounds: expected an integer >= 1, got '0'"),
        ("step_protocol", ["--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
        ("http_throughput", ["--streams", "0"], "argument --streams: expected an integer >= 1, got '0'"),
        ("attention", ["--batches", "1,0"], "argument --batches: expected comma-separated integers >= 1, got '1,0'"),
        ("sim_fidelity", ["--cost-model", "x", "--qps", "nan"], "argument --qps: expected a finite number > 0"),
        ("gpu_serving", ["--scale", "0"], "argument --scale: expected a finite number > 0, got '0'"),
        ("gpu_serving", ["--scale", "-1"], "argument --scale: expected a finite number > 0, got '-1'"),
        ("gpu_serving", ["--batches", "abc"], "argument --batches: expected comma-separated integers >= 1, got 'abc'"),
        ("gpu_serving", ["--batches", "0"], "argument --batches: expected comma-separated integers >= 1, got '0'"),
        ("gpu_serving", ["--decode-context", "0"], "argument --decode-context: expected an integer >= 1, got '0'"),
        ("gpu_serving", ["--decode-steps", "0"], "argument --decode-steps: expected an integer >= 1, got '0'"),
        ("gpu_serving", ["--profile-batch", "-1"], "argument --profile-batch: expected an integer >= 0, got '-1'"),
        ("gpu_serving", ["--repeat", "0"], "argument --repeat: expected an integer >= 1, got '0'"),
        ("gpu_serving", ["--hf-prompts", "0"], "argument --hf-prompts: expected an integer >= 1, got '0'"),
        ("gpu_serving", ["--hf-batch", "0"], "argument --hf-batch: expected an integer >= 1, got '0'"),
        ("gpu_serving", ["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
        ("gpu_serving", ["--grpc-port", "-1"], "argument --grpc-port: expected an integer >= 0, got '-1'"),
        ("gpu_serving", ["--grpc-port", "65536"], "--grpc-port 65536: a port is at most 65535"),
        ("gpu_serving", ["--parts", "xyz"],
         "argument --parts: expected some of the letters abcde, e.g. 'ac', got 'xyz'"),
        ("gpu_serving", ["--parts", ""], "argument --parts: expected some of the letters abcde, e.g. 'ac', got ''"),
        ("gpu_serving", ["--model", "/nonexistent/model"],
         "argument --model: '/nonexistent/model' is not a model directory: no such directory"),
        ("calibrate_cost_model", ["--out", "cost.json", "--model", "/nonexistent/model"],
         "argument --model: '/nonexistent/model' is not a model directory: no such directory"),
        ("calibrate_cost_model", ["--out", "cost.json", "--seed", "-1"],
         "argument --seed: expected an integer >= 0, got '-1'"),
        # --device and a run past the context: tracebacks before, once the work had started.
        ("calibrate_cost_model", ["--out", "cost.json", "--device", "foo"],
         "argument --device: expected cpu or cuda, got 'foo'"),
        ("gpu_serving", ["--device", "gpu"], "argument --device: expected cpu or cuda, got 'gpu'"),
        ("sim_fidelity", ["--device", "foo"], "argument --device: expected cpu or cuda, got 'foo'"),
        ("step_pipeline", ["--requests", "2", "--output-tokens", "5000"],
         "--output-tokens: at most 3968 (the stand-in's context of 4096 tokens less the longest prompt's 128), "
         "got 5000"),
        ("http_throughput", ["--streams", "1", "--max-tokens", "3000"], "--max-tokens: at most 20"),
    ],
)
def test_a_bad_number_is_a_usage_error_naming_the_flag(bench, argv, message, capsys) -> None:  # noqa: ANN001
    main = importlib.import_module(f"kvserve.bench.{bench}").main
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_simulator_scale_refuses_an_unknown_policy_and_lists_the_known_ones(capsys) -> None:  # noqa: ANN001
    from kvserve.bench.simulator_scale import main

    with pytest.raises(SystemExit) as info:
        main(["--policy", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --policy: invalid choice: 'bogus'" in err
    assert all(name in err for name in ("round_robin", "least_loaded", "consistent_hash", "cache_aware", "cost_ttft"))


def test_simulator_scale_refuses_replicas_too_small_for_one_request_before_the_stream_is_made(
    capsys, monkeypatch  # noqa: ANN001
) -> None:
    from kvserve.bench import simulator_scale

    monkeypatch.setattr(simulator_scale, "run", lambda *args: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as info:
        simulator_scale.main(["--replicas", "2", "--requests", "20", "--kv-blocks", "10"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    # The default stream's prompt: a 2,048-token system prompt and a 128-token question, 136 blocks of 16.
    assert "--kv-blocks 10: a replica cannot serve one request" in err
    assert "136 KV blocks" in err


def test_simulator_scale_help_says_what_the_default_process_count_rests_on(capsys) -> None:  # noqa: ANN001
    from kvserve.bench.simulator_scale import main

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "2 where this process may run on two or more cores, else 1; their load is not checked" in help_text


def test_e2e_throughput_says_whether_each_scheduling_met_the_target() -> None:
    from kvserve.bench.e2e_throughput import target_line

    line = target_line({"plain": 0.55, "overlapped": 0.7})
    assert line.endswith(": plain 0.55 NOT met, overlapped 0.70 met")


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "x", ""])
def test_float_above_zero_refuses_what_is_not_a_finite_positive_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number > 0"):
        float_above(0)(text)


def test_float_above_zero_takes_a_positive_fraction() -> None:
    assert float_above(0)("0.25") == 0.25


def test_int_at_least_takes_its_minimum_and_refuses_one_less() -> None:
    assert int_at_least(1)("1") == 1
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer >= 1, got '0'"):
        int_at_least(1)("0")


@pytest.mark.parametrize("text", ["", "0", "1,0", "1,,2", "a", "1.5"])
def test_positive_ints_refuses_an_empty_or_non_positive_list(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers >= 1"):
        positive_ints(text)


def test_positive_ints_reads_a_comma_separated_list() -> None:
    assert positive_ints("1,16,64") == (1, 16, 64)


def test_gpu_serving_help_states_every_default(capsys) -> None:  # noqa: ANN001
    from kvserve.bench.gpu_serving import main

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--decode-context", "1024"), ("--decode-steps", "20"), ("--profile-batch", "64; 0: off"),
                          ("--scale", "1.0"), ("--repeat", "1"), ("--hf-prompts", "64"), ("--hf-batch", "64"),
                          ("--grpc-port", "0: a free one, chosen when it starts"), ("--seed", "0")):
        flag_help = help_text.split(f" {flag} ", 1)[1].split(" --", 1)[0]
        assert f"(default {default}" in flag_help, flag


def test_calibrate_help_says_what_block_size_and_seed_are(capsys) -> None:  # noqa: ANN001
    from kvserve.bench.calibrate_cost_model import main

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--block-size BLOCK_SIZE tokens per KV block of the replica timed (default 16)" in help_text
    assert "--seed SEED seed of the model's weights and the timed prompts (default 0)" in help_text


def test_no_cuda_device_exits_1_in_both_attention_benchmarks(capsys, monkeypatch) -> None:  # noqa: ANN001
    import torch

    from kvserve.bench import attention, prefill_attention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert attention.main([]) == 1
    assert prefill_attention.main([]) == 1
    err = capsys.readouterr().err
    assert "kvserve.bench.attention needs a CUDA device, and none is visible" in err
    assert "kvserve.bench.prefill_attention needs a CUDA device, and none is visible" in err


def test_attention_refuses_an_unwritable_json_before_looking_for_a_device(capsys, monkeypatch) -> None:  # noqa: ANN001
    import torch

    from kvserve.bench import attention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("the device was looked for first"))
    with pytest.raises(SystemExit) as info:
        attention.main(["--json", "/proc/kvserve-attention.json"])
    assert info.value.code == 2
    assert "--json /proc/kvserve-attention.json: No such file or directory" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_without_a_cuda_device_is_a_usage_error(capsys) -> None:  # noqa: ANN001
    from kvserve.bench.calibrate_cost_model import main

    with pytest.raises(SystemExit) as info:
        main(["--out", "cost.json", "--device", "cuda", "--quick"])
    assert info.value.code == 2
    assert "argument --device: cuda: no CUDA device is visible" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{}", "config.json cannot be read"),
        ('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}',
         "kvserve does not run GPT2LMHeadModel; it runs LlamaForCausalLM, MistralForCausalLM"),
    ],
)
def test_a_model_directory_kvserve_cannot_load_is_a_usage_error(tmp_path, capsys, config, message) -> None:  # noqa: ANN001
    from kvserve.bench.offline_throughput import main

    (tmp_path / "config.json").write_text(config)
    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path)])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_gpu_serving_refuses_a_scale_whose_workloads_pass_the_models_context(capsys) -> None:  # noqa: ANN001
    from kvserve.bench.gpu_serving import main

    assert main(["--device", "cpu", "--parts", "c", "--scale", "2.1"]) == 2
    assert "--scale 2.1: the mixed workload's requests reach" in capsys.readouterr().err

