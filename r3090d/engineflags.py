"""A flag's value in engine.extra_args, read the way vLLM's own parser reads it.

Pure, the standard library only, so config loading, the core, preflight and the CLI all
ask here and cannot disagree. vLLM parses its command line with argparse,
after turning the underscores of a long flag's name into dashes
(`--max_model_len` is `--max-model-len`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# vLLM 0.32's own values where the command line leaves a flag out, for its
# OpenAI API server on a card under 70 GiB (EngineArgs.get_batch_defaults): what
# the engine then runs with, so plan, preflight and config check assume them too.
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
VLLM_DEFAULT_MAX_NUM_SEQS = 256
VLLM_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# argparse takes an argument that starts with "-" as a value only when it is a negative number.
_NEGATIVE_NUMBER = re.compile(r"-\d+$|-\d*\.\d+$")


def canonical_flag(arg: str) -> str:
    """The flag `arg` names, spelled as vLLM's parser sees it: "--max_model_len=8" -> "--max-model-len".

    Underscores in a long flag's name, up to its first ".", become dashes;
    short flags ("-tp") and anything else come back as they are (less any "=value").
    """
    name = arg.split("=", 1)[0]
    if not name.startswith("--"):
        return name
    head, dot, tail = name[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + tail


def _is_flag(arg: str) -> bool:
    return arg.startswith("-") and not _NEGATIVE_NUMBER.match(arg)


def flag_value(args: Sequence[str], flag: str, *aliases: str) -> str | None:
    """The value vLLM takes for `flag` (or an alias, e.g. "-tp"): the last occurrence wins, as "--flag value",
    "--flag=value" or "--flag_name"; None when it is not given a value."""
    found = flag_occurrence(args, flag, *aliases)
    return found[1] if found is not None else None


def flag_occurrence(args: Sequence[str], flag: str, *aliases: str) -> tuple[int, str] | None:
    """(index of the flag in `args`, its value) for the occurrence flag_value() takes; None when none has a value."""
    names = {canonical_flag(f) for f in (flag, *aliases)}
    found = None
    i = 0
    while i < len(args):
        arg = str(args[i])
        if _is_flag(arg) and canonical_flag(arg) in names:
            if "=" in arg:
                found = (i, arg.split("=", 1)[1])
            elif i + 1 < len(args) and not _is_flag(str(args[i + 1])):
                found = (i, str(args[i + 1]))
                i += 1
        i += 1
    return found


def flag_switch(args: Sequence[str], flag: str) -> bool | None:
    """A boolean flag: True for "--flag", False for "--no-flag", the last one winning; None when neither is given."""
    on = canonical_flag(flag)
    off = "--no-" + on.removeprefix("--")
    state = None
    for arg in map(str, args):
        name = canonical_flag(arg) if _is_flag(arg) else None
        if name in (on, off):
            state = name == on
    return state
