"""The settings' errors in flag terms: fields, switches' values and the config file named as set."""

from __future__ import annotations

import argparse

from kvserve.cluster.cli_flag_terms import FlagTerms


def terms() -> FlagTerms:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-model-len", "-m", type=int)
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int)
    parser.add_argument("--no-chunked-prefill", action="store_const", const=False, dest="enable_chunked_prefill")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--auth-token-file")
    parser.add_argument("--routing-arg", dest="routing_args")
    return FlagTerms.of_parser(parser, verbatim=frozenset({"routing_args"}))


def test_the_leading_field_is_its_longest_flag_and_the_file_is_named_when_it_gave_the_value():
    error = ValueError("tensor_parallel_size must be >= 1, got 0")

    assert terms().message(error) == "--tensor-parallel-size must be >= 1, got 0"
    assert terms().message(error, frozenset({"tensor_parallel_size"}), "serve.yaml") == (
        "--tensor-parallel-size must be >= 1, got 0 (--tensor-parallel-size from --config serve.yaml)"
    )


def test_fields_later_in_the_message_and_switch_values_are_named_by_their_flags():
    message = terms().message(ValueError(
        "x: max_model_len too long unless enable_chunked_prefill=False, async_scheduling=True or "
        "async_scheduling=False, enforce_eager=True"
    ))

    assert message == (
        "x: --max-model-len too long unless --no-chunked-prefill, --async-scheduling or --no-async-scheduling, "
        "--enforce-eager"
    )


def test_words_that_are_no_setting_and_values_no_switch_gives_stay_as_they_are():
    # (a routing policy's arguments, max_model_len=None, are its own, not serve's flags)
    message = "max_model_len: enable_chunked_prefill=True is the default; unknown_field, port, max_model_len( " \
        "and max_model_len=None"

    assert terms().message(ValueError(message)) == (
        "--max-model-len: enable_chunked_prefill=True is the default; unknown_field, port, max_model_len( "
        "and max_model_len=None"
    )


def test_a_field_beside_its_flag_already_is_left_alone():
    message = "x needs an auth token file (auth_token_file, --auth-token-file)"

    assert terms().message(ValueError(message)) == message


def test_a_verbatim_settings_message_names_things_of_its_own():
    # A routing policy's argument max_model_len is not serve's --max-model-len.
    message = terms().message(ValueError("routing_args: max_model_len must be >= 1"))

    assert message == "--routing-arg: max_model_len must be >= 1"
