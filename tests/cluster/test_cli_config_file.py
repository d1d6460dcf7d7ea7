"""``kvserve serve --config FILE.yaml``: serve's flags from a file, which the command line overrides."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from kvserve.cli import main
from kvserve.worker.tiny_model import create_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("cli-model"), "llama", seed=0)


def parsed(tmp_path: Path, text: str, *argv: str) -> argparse.Namespace:
    """``kvserve serve --config FILE *argv`` parsed, FILE holding ``text``."""
    from kvserve.cli import _subcommand_parser, build_parser
    from kvserve.cluster.cli_config_file import parse_args_with_config_file

    path = tmp_path / "serve.yaml"
    path.write_text(text)
    parser = build_parser()
    return parse_args_with_config_file(
        parser, _subcommand_parser(parser, "serve"), ["serve", "--config", str(path), *argv], "serve"
    )


def test_a_config_file_sets_serves_flags_and_the_command_line_overrides_them(tmp_path):
    config = "model: /models/m\nport: 6000\nmax_num_seqs: 8\nrouting-arg: [cache_threshold=0.5]\nno-http: true\n"
    args = parsed(tmp_path, config, "--port", "7000")

    assert args.model == Path("/models/m")
    assert args.port == 7000
    assert args.max_num_seqs == 8
    assert args.routing_args == [("cache_threshold", 0.5)]
    assert args.http_port is None


@pytest.mark.parametrize(
    ("config", "argv", "http_port"),
    [
        ("no-http: true\n", ["--http-port", "8091"], 8091),
        ("http-port: 8091\n", ["--no-http"], None),
        ("http-port: 8091\n", [], 8091),
        ("no-http: true\n", [], None),
        ("http-port: 8091\n", ["--http-port", "100"], 100),
    ],
)
def test_the_command_lines_http_flag_wins_over_the_config_files_other_one(tmp_path, config, argv, http_port):
    # Each refused the other: "argument --http-port: not allowed with argument --no-http".
    assert parsed(tmp_path, config, *argv).http_port == http_port


@pytest.mark.parametrize("config", ["", "http-port: 100\n", "no-http: true\n"])
def test_http_port_and_no_http_together_on_the_command_line_stay_an_error(capsys, tmp_path, config):
    # 100: an int argparse caches, which it would take for the default (not given) had the file set it.
    with pytest.raises(SystemExit) as exit_info:
        parsed(tmp_path, config, "--http-port", "100", "--no-http")
    assert exit_info.value.code == 2
    assert "argument --no-http: not allowed with argument --http-port" in capsys.readouterr().err


def test_http_port_and_no_http_together_in_a_config_file_are_an_error_naming_it(capsys, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("http-port: 8091\nno-http: true\n")

    assert main(["serve", "--config", str(path), "--http-port", "8092"]) == 2
    assert capsys.readouterr().err == (
        f"kvserve serve: error: --config {path}: argument --no-http: not allowed with argument --http-port\n"
    )


def test_a_repeatable_flag_on_the_command_line_replaces_the_config_files_list(tmp_path):
    config = "routing-arg: [cache_threshold=0.5, balance_abs_threshold=32]\n"
    args = parsed(tmp_path, config, "--routing-arg", "cache_threshold=0.7")
    assert args.routing_args == [("cache_threshold", 0.7)]


def test_a_switch_the_config_file_sets_stays_set_when_the_command_line_says_nothing(tmp_path):
    args = parsed(tmp_path, "enforce-eager: true\nasync-scheduling: false\n", "--port", "1")
    assert args.enforce_eager is True
    assert args.async_scheduling is False


@pytest.mark.parametrize(
    "text, argv, expected",
    [
        ("", (), None),  # the default: decided by the replicas' executor
        ("async-scheduling: true\n", (), True),
        ("async-scheduling: false\n", (), False),
        ("no-async-scheduling: true\n", (), False),
        ("no-async-scheduling: false\n", (), True),
        ("async-scheduling: false\n", ("--async-scheduling",), True),
        ("async-scheduling: true\n", ("--no-async-scheduling",), False),
    ],
)
def test_async_scheduling_is_on_off_or_left_to_the_replicas_from_the_file_and_the_command_line(
    tmp_path, text, argv, expected
):
    assert parsed(tmp_path, text, "--port", "1", *argv).async_scheduling is expected


def test_a_config_file_value_that_starts_with_a_dash_is_a_value(tmp_path):
    # It was passed as two arguments, "--host -x": argparse took "-x" for a flag.
    assert parsed(tmp_path, "host: -x\n").host == "-x"


def test_a_config_file_is_checked_as_the_flags_are(capsys, tmp_path, model_dir):
    path = tmp_path / "serve.yaml"
    path.write_text(f"model: {model_dir}\nport: 0\ntp: 3\n")

    assert main(["serve", "--config", str(path)]) == 2
    assert "--tp 3 cannot split the model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        ("max-num-seq: 8\n", "unknown key 'max-num-seq'; the keys are serve's flags: "),
        ("simulated: 1\n", "simulated is a switch: true or false, got 1"),
        ("port: [1, 2]\n", "port takes one value, got a list"),
        ("- port\n", "expected a mapping of flag names to values, got list"),
        ("port: [\n", "not valid YAML"),
        ("replicas: 2\nport: 1\nreplicas: 3\n", "not valid YAML: the key 'replicas' is given twice"),
        ("max_num_seqs: 2\nmax-num-seqs: 4\n", "'max_num_seqs' and 'max-num-seqs' are the same flag, --max-num-seqs"),
    ],
)
def test_a_bad_config_file_is_refused_before_starting_anything(capsys, tmp_path, text, message):
    path = tmp_path / "serve.yaml"
    path.write_text(text)

    assert main(["serve", "--config", str(path)]) == 2
    assert f"kvserve serve: error: --config {path}: {message}" in capsys.readouterr().err


def test_yaml_merge_keys_still_work_beside_the_check_of_repeated_keys():
    import yaml

    from kvserve.cluster.cli_config_file import _loader_refusing_repeated_keys

    text = "common: &common {a: 1, b: 2}\nmine:\n  <<: *common\n  b: 3\n"
    assert yaml.load(text, Loader=_loader_refusing_repeated_keys()) == {"common": {"a": 1, "b": 2}, "mine": {"a": 1, "b": 3}}


def test_a_missing_config_file_is_refused(capsys, tmp_path):
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: No such file or directory" in capsys.readouterr().err


def written(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    from kvserve.cli import _subcommand_parser, build_parser
    from kvserve.cluster.cli_config_file import parse_args_with_config_file

    parser = build_parser()
    return parse_args_with_config_file(parser, _subcommand_parser(parser, "serve"), argv, "serve")


@pytest.mark.parametrize("flag", ["--conf", "--confi", "--config"])
def test_an_abbreviated_config_flag_reads_the_file_as_argparse_takes_it(tmp_path, flag):
    # An abbreviation was taken by argparse, and the file never read: the server came up on port 50051.
    path = written(tmp_path, "a.yaml", "port: 50181\n")

    args = parse(["serve", flag, str(path)])

    assert args.port == 50181 and args.settings_from_file == {"port"}


def test_the_last_of_two_config_files_is_read_as_for_any_flag(tmp_path):
    first, second = written(tmp_path, "a.yaml", "port: 50181\n"), written(tmp_path, "b.yaml", "port: 50182\n")

    assert parse(["serve", "--config", str(first), "--config", str(second)]).port == 50182


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["--log-level", "error", "serve"], logging.ERROR),  # before the command
        (["serve", "--log-level", "error"], logging.ERROR),
        (["-v", "serve"], logging.DEBUG),  # -v is --log-level debug: it overrides the file's level
        (["serve", "-v"], logging.DEBUG),
        (["serve"], logging.INFO),  # the file's
    ],
)
def test_a_log_level_on_the_command_line_wins_over_the_files_before_or_after_the_command(tmp_path, argv, level):
    from kvserve.cli import log_level

    path = written(tmp_path, "f.yaml", "log-level: info\n")

    assert log_level(parse([*argv, "--config", str(path)])) == level


def test_a_bad_value_from_the_file_names_the_file_not_only_the_flag(capsys, tmp_path, model_dir):
    path = written(tmp_path, "f.yaml", f"model: {model_dir}\nreplicas: 0\n")

    assert main(["serve", "--config", str(path), "--port", "0"]) == 2

    err = capsys.readouterr().err
    assert err.startswith("kvserve serve: error: --replicas must be") and f"(--replicas from --config {path})" in err
    assert main(["serve", "--config", str(path), "--port", "0", "--replicas", "-1"]) == 2
    err = capsys.readouterr().err
    assert "kvserve serve: error: --replicas must be" in err and "from --config" not in err  # the command line's

