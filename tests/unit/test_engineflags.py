"""A flag's value in engine.extra_args, read as vLLM's own parser reads it."""

from __future__ import annotations

import pytest

from r3090d.engineflags import canonical_flag, flag_occurrence, flag_switch, flag_value


@pytest.mark.parametrize(
    "args, value",
    [
        ([], None),
        (["--max-model-len", "4096"], "4096"),
        (["--max-model-len=4096"], "4096"),
        (["--max_model_len", "4096"], "4096"),
        (["--max_model_len=4096"], "4096"),
        (["--max-model-len", "4096", "--max-model-len", "8192"], "8192"),  # the last one wins
        (["--max-model-len=8192", "--max_model_len", "2048"], "2048"),
        (["--max-model-len", "4096", "--max-model-len"], "4096"),  # no value: vLLM refuses it anyway
        (["--max-model-len-x", "1", "--max-model", "2"], None),  # other flags, not prefixes
        (
            ["--max-model-len", "--max-model-len=9"],
            "9",
        ),  # argparse takes nothing that looks like a flag as a value
        (["--served-model-name", "--max-model-len", "-1"], "-1"),  # but a negative number is a value
        (['--kv-transfer-config={"a": "b=c"}', "--max-model-len=4=4"], "4=4"),
    ],
)
def test_flag_value(args, value):
    assert flag_value(args, "--max-model-len") == value


def test_flag_occurrence_is_where_the_value_flag_value_takes_stands():
    assert flag_occurrence(["--enforce-eager", "--max-model-len", "8", "--max_model_len=9"], "--max-model-len") == (3, "9")
    assert flag_occurrence(["--max-model-len", "8", "--max-model-len"], "--max-model-len") == (0, "8")
    assert flag_occurrence(["--enforce-eager"], "--max-model-len") is None


def test_aliases_are_one_flag_and_the_last_of_them_wins():
    assert flag_value(["-tp", "2", "--tensor-parallel-size=4"], "--tensor-parallel-size", "-tp") == "4"
    assert flag_value(["--tensor_parallel_size", "4", "-tp", "8"], "--tensor-parallel-size", "-tp") == "8"


def test_the_flag_may_be_asked_for_in_either_spelling():
    assert flag_value(["--kv-cache-dtype", "fp8"], "--kv_cache_dtype") == "fp8"


@pytest.mark.parametrize(
    "arg, flag",
    [("--max_model_len=4_096", "--max-model-len"), ("--compilation_config.cudagraph_mode=x", "--compilation-config.cudagraph_mode"), ("--enforce_eager", "--enforce-eager"), ("-tp", "-tp"), ("-O3", "-O3"), ("fp8_e4m3", "fp8_e4m3")],
)  # fmt: skip
def test_canonical_flag(arg, flag):
    assert canonical_flag(arg) == flag


@pytest.mark.parametrize(
    "args, on",
    [([], None), (["--enforce-eager"], True), (["--enforce_eager"], True), (["--enforce-eager", "--no-enforce-eager"], False),
     (["--no_enforce_eager", "--enforce-eager"], True), (["--enforce-eager-x"], None)],
)  # fmt: skip
def test_flag_switch(args, on):
    assert flag_switch(args, "--enforce-eager") is on
