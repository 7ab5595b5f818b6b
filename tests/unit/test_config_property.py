"""Any document shaped like the configuration loads to a Config whose every
float is finite, or is refused with a one-line ConfigError. Nothing else, ever.

Documents are built from the real schema (the dataclasses' own fields, plus
misspelt, unknown and removed keys) with values of every TOML type: booleans,
integers far beyond 64 bits, floats including NaN and infinities, strings that
are long, hold NUL or odd Unicode, dates and times, lists, tables, and nesting
thousands deep. They go through `from_dict` as data and through `load` as TOML
text (written by `toml_text` below, for whatever TOML can represent).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
import sys
import typing

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from r3090d import config as configmod
from r3090d.config import Config, ConfigError

PROPERTY = settings(
    deadline=None,
    derandomize=True,
    max_examples=1000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# ------------------------------------------------------------------ values

INTS = st.one_of(
    st.integers(-10, 70_000),
    st.integers(-(1 << 80), 1 << 80),
    st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 2**64, 1 << 1100, -(1 << 1100)]),
    # More digits than int() and str() convert (4300); built in a map, as hypothesis reprs its strategies.
    st.sampled_from([4400, 5000, -5000]).map(lambda d: 10 ** abs(d) * (1 if d > 0 else -1)),
)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308]),
)
TEXTS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "",
            "m",
            sys.executable,
            "/nonexistent/x",
            "~nosuchuser-r3090d/model",
            "realtime",
            "batch",
            "none",
            "starttls",
            "rtx3090",
            "any",
            "hw_slowdown",
            "hw_slowdwn",
            "127.0.0.1",
            "0.0.0.0",
            "::1",
            "localhost",
            "--disable-log-stats",
            "--max-num-seqs",
            "--api-key=x",
            "VLLM_API_KEY",
            "ops@example.org",
            "/dev/zero",
        ]
    ),
    st.integers(200, 5000).map(lambda n: "x" * n),
    st.integers(120, 300).map(lambda n: "/srv/" + "é" * n + "/m"),
    st.just(200_000).map(lambda n: "m" * n),
    st.text(max_size=5).map(lambda s: s + "\0" + s),
    # A lone surrogate (only from_dict can carry one), line breaks, a BOM, an escape sequence.
    st.sampled_from(["\ud800", "a\udcff", "a\u2028b", "\ufeffx", "🙂", "\x1b[31m", "e\u0301", "a\nb", "a\rb"]),
)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
DATES = st.one_of(st.dates(), st.datetimes(), st.times(), st.datetimes(timezones=st.just(datetime.UTC)))
SCALARS = st.one_of(st.booleans(), INTS, FLOATS, TEXTS, DATES)
ODD_KEYS = st.one_of(st.text(max_size=8), st.sampled_from(["", "a b", "ключ", "a\nb", "a=b", "a.b"]), st.just(300).map(lambda n: "x" * n))


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, by weight. (st.one_of flattens nested one_ofs, so
    a branch's share there is its count of leaf strategies, not 1/n.)"""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    # By index: hypothesis reprs its strategies, and a list of them would repr every one.
    return st.sampled_from(range(len(table))).flatmap(lambda i: table[i])


def _nest(depth: int, leaf, as_table: bool):
    for _ in range(depth):
        leaf = {"k": leaf} if as_table else [leaf]
    return leaf


DEEP = st.builds(_nest, st.integers(2, 3000), SCALARS, st.booleans())
ANY = st.one_of(
    st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ODD_KEYS, inner, max_size=3), max_leaves=6),
    DEEP,
)

# ------------------------------------------------------------------ schema

# Keys that left the schema and are still read (with a warning) or must be refused.
REMOVED_WATCHDOG_KEYS = ("give_up_restarts", "give_up_window", "stable_after")


def _typed(f: dataclasses.Field, hint) -> st.SearchStrategy:
    """Values the field's type and range accept, most of the time, so that documents get past the type checks."""
    spec = f.metadata.get("spec")
    lo = getattr(spec, "lo", None)
    hi = getattr(spec, "hi", None)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(int(lo), int(hi)) if lo is not None and hi is not None else INTS
    if hint is float:
        return st.floats(lo, hi) if lo is not None and hi is not None else FLOATS
    if hint is str:
        choices = getattr(spec, "choices", None)
        return st.sampled_from(choices) if choices else TEXTS
    if hint is list:
        allowed = getattr(spec, "item_choices", None)
        return st.lists(st.sampled_from(sorted(allowed)) | SCALARS if allowed else TEXTS | SCALARS, max_size=4)
    if hint is dict and f.name == "profiles":
        return st.dictionaries(st.sampled_from(["realtime", "batch", "mine"]) | ODD_KEYS, _table(configmod.Profile) | ANY, max_size=3)
    if hint is dict:
        return st.dictionaries(st.sampled_from(["HF_HOME", "VLLM_API_KEY", "A=B", ""]) | ODD_KEYS, TEXTS | SCALARS, max_size=4)
    return ANY


def _table(cls) -> st.SearchStrategy:
    """A table for a dataclass section: any subset of its keys, sometimes a misspelt or unknown one."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name not in configmod.DERIVED_FIELDS]
    optional = {}
    for f in fields:
        hint = hints[f.name]
        typed = _table(hint) if dataclasses.is_dataclass(hint) else _typed(f, hint)
        optional[f.name] = weighted((3, typed), (1, ANY))
    if cls is configmod.WatchdogConfig:
        optional.update({k: st.one_of(INTS, FLOATS, st.floats(1, 1000), ANY) for k in REMOVED_WATCHDOG_KEYS})
    names = [f.name for f in fields]
    wrong_keys = st.one_of(
        st.sampled_from(names).map(lambda k: k[:-1] or "x"),
        ODD_KEYS,
        st.sampled_from(sorted(configmod.DERIVED_FIELDS)),
    )
    extra = st.dictionaries(wrong_keys, ANY, max_size=1)
    return st.builds(lambda main, more, use_more: {**main, **more} if use_more else main, st.fixed_dictionaries({}, optional=optional), extra, st.integers(0, 9).map(lambda n: n == 0))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def _leaves(cls, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], st.SearchStrategy]]:
    """Every key of the schema as a path, with the values to try there."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name in configmod.DERIVED_FIELDS:
            continue
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += _leaves(hint, (*prefix, f.name))
            out.append(((*prefix, f.name), ANY))  # the whole section replaced
            continue
        if f.name == "profiles":
            for name in ("realtime", "batch", "mine"):
                out += _leaves(configmod.Profile, (*prefix, f.name, name))
        typed = _typed(f, hint)
        if f.default is not dataclasses.MISSING:  # the default keeps the rest of the document valid
            typed = weighted((1, st.just(f.default)), (2, typed))
        out.append(((*prefix, f.name), weighted((6, typed), (2, NON_FINITE), (1, FLOATS), (1, SCALARS), (1, ANY))))
    if cls is configmod.WatchdogConfig:
        old_values = weighted((3, st.integers(0, 1001)), (3, st.floats(0, 1e6)), (1, NON_FINITE), (1, FLOATS), (1, ANY))
        out += [((*prefix, k), old_values) for k in REMOVED_WATCHDOG_KEYS]
    return out


LEAVES = _leaves(Config)


def _set(doc: dict, path: tuple[str, ...], value) -> dict:
    head, *rest = path
    inner = doc.get(head)
    return {**doc, head: _set(inner if isinstance(inner, dict) else {}, tuple(rest), value) if rest else value}


def _mutations(leaf) -> st.SearchStrategy:
    path, values = leaf
    return values.map(lambda value: (path, value))


# A valid core, so that most documents reach the cross-key checks and not only the type checks.
VALID_CORE = {"profile": "none", "engine": {"model": "m"}, "gpu": {"required": False}}
# The core with one or two keys set to anything: a single NaN, a single bad
# list item, must not slip through on an otherwise valid document.
MUTATED = st.lists(st.sampled_from(LEAVES).flatmap(_mutations), min_size=1, max_size=2).map(
    lambda changes: _apply(VALID_CORE, changes)
)


def _apply(doc: dict, changes) -> dict:
    for path, value in changes:
        doc = _set(doc, path, value)
    return doc


TABLES = weighted((5, MUTATED), (2, _table(Config).map(lambda doc: _merge(VALID_CORE, doc))), (1, _table(Config)))
DOCUMENTS = weighted((8, TABLES), (1, ANY))

# ---------------------------------------------------------------- checking


def floats_in(obj):
    if isinstance(obj, float):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from floats_in(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from floats_in(key)
            yield from floats_in(value)
    elif isinstance(obj, list | tuple | set | frozenset):
        for item in obj:
            yield from floats_in(item)


def check_outcome(load) -> Config | None:
    """The loader's only two outcomes: a Config, every float of it finite, or a one-line ConfigError."""
    try:
        cfg = load()
    except ConfigError as exc:
        line = exc.one_line()
        assert line and "\n" not in line and "\r" not in line and len(line) < 4000, line[:300]
        return None
    assert isinstance(cfg, Config)
    values = list(floats_in(cfg)) + list(floats_in(configmod.resolve_profiles(cfg)))
    assert all(math.isfinite(v) for v in values), cfg
    configmod.redacted(cfg)  # what `r3090ctl config check` prints must not fail either
    return cfg


@PROPERTY
@given(doc=DOCUMENTS, instance=st.one_of(st.none(), st.integers(0, 63), st.integers(-3, 200)))
def test_from_dict_gives_a_finite_config_or_a_config_error(doc, instance):
    check_outcome(lambda: configmod.from_dict(doc, "prop.toml", instance, check_files=False))


# ------------------------------------------------------------- TOML text


class Unrepresentable(Exception):
    pass


_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _toml_string(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if 0xD800 <= code <= 0xDFFF:
            raise Unrepresentable("TOML text cannot hold a lone surrogate")
        if ch in '"\\':
            out.append("\\" + ch)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(key) -> str:
    if not isinstance(key, str):
        raise Unrepresentable("TOML keys are strings")
    return key if _BARE.fullmatch(key) else _toml_string(key)


def _toml_int(n: int) -> str:
    if n.bit_length() < 10_000:
        return str(n)
    if n > 0:
        return hex(n)  # str() refuses; hex has no digit limit, and TOML reads it
    digits = []  # a negative one has no hex form in TOML: decimal, in chunks str() accepts
    rest = -n
    while rest:
        rest, chunk = divmod(rest, 10**1000)
        digits.append(f"{chunk:01000d}" if rest else str(chunk))
    return "-" + "".join(reversed(digits))


def toml_value(value) -> str:
    # A chain of one-element lists or one-key tables (the deep nesting) is written without recursion.
    opens, closes = [], []
    while True:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list | dict):
            opens.append("[")
            closes.append("]")
            value = value[0]
        elif isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value.values())), list | dict):
            key, inner = next(iter(value.items()))
            opens.append("{ " + _toml_key(key) + " = ")
            closes.append(" }")
            value = inner
        else:
            break
    return "".join(opens) + _toml_leaf(value) + "".join(reversed(closes))


def _toml_leaf(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return _toml_int(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, datetime.datetime | datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise Unrepresentable(type(value).__name__)


def toml_text(doc: dict) -> str:
    """The document as TOML: top-level keys, sections as inline tables (equivalent to [section])."""
    return "".join(f"{_toml_key(key)} = {toml_value(value)}\n" for key, value in doc.items())


def test_toml_writer_round_trips():
    import tomllib

    doc = {"a": [1, [2.5, "x\"\\\n\0"]], "b c": {"d": True, "e": datetime.date(2024, 1, 2)}, "f": _nest(50, 1, False)}
    assert tomllib.loads(toml_text(doc)) == doc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("property")


@PROPERTY
@given(doc=TABLES, bom=st.booleans(), instance=st.one_of(st.none(), st.integers(0, 63)))
def test_load_of_toml_text_gives_a_finite_config_or_a_config_error(workdir, doc, bom, instance):
    try:
        text = toml_text(doc)
    except Unrepresentable:
        assume(False)
    path = workdir / "r3090d.toml"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    check_outcome(lambda: configmod.load(path, instance, check_files=False))


# ------------------------------------------------------------ real files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Secret files of every kind, and a model directory, for check_files=True."""
    d = tmp_path_factory.mktemp("secrets")
    (d / "model").mkdir()
    made = {"model": d / "model", "dir": d, "missing": d / "absent", "dev-zero": "/dev/zero"}
    for name, content in {
        "good": b"s3cret\n",
        "empty": b"",
        "blank": b" \n",
        "two-lines": b"a\nb\n",
        "nul": b"a\0b",
        "latin1": b"caf\xe9",
        "big": b"k" * (configmod.SECRET_MAX_BYTES + 1),
        "at-cap": b"k" * configmod.SECRET_MAX_BYTES,
    }.items():
        made[name] = d / name
        made[name].write_bytes(content)
    made["fifo"] = d / "fifo"
    os.mkfifo(made["fifo"])
    made["link-to-fifo"] = d / "link-to-fifo"
    made["link-to-fifo"].symlink_to(made["fifo"])
    return {k: str(v) for k, v in made.items()}


SECRET_NAMES = ["good", "empty", "blank", "two-lines", "nul", "latin1", "big", "at-cap", "fifo", "link-to-fifo", "dir", "missing", "dev-zero"]


@PROPERTY
@given(
    doc=_table(Config),
    api_key=st.sampled_from(SECRET_NAMES),
    password=st.sampled_from(SECRET_NAMES),
    email_on=st.booleans(),
    keep_overrides=st.integers(0, 3),
)
def test_check_files_with_real_secret_files(files, doc, api_key, password, email_on, keep_overrides):
    core = {
        "profile": "none",
        "engine": {"python": sys.executable, "model": files["model"], "api_key_file": files[api_key]},
        "gpu": {"required": False},
        "alerts": {"email": {"enabled": email_on, "recipients": ["ops@example.org"], "username": "u", "password_file": files[password]}},
    }
    # Mostly the valid core alone (so the secrets are read), sometimes with generated keys over it.
    data = _merge(core, doc) if keep_overrides == 0 else core
    cfg = check_outcome(lambda: configmod.from_dict(data, "prop.toml", check_files=True))
    if cfg is not None and data is core:
        assert api_key in ("good", "at-cap"), api_key
        assert cfg.api_key == ("s3cret" if api_key == "good" else "k" * configmod.SECRET_MAX_BYTES)
        # The loader checks that the password file can be read; what it holds is the SMTP channel's business.
        assert not email_on or password not in ("latin1", "big", "fifo", "link-to-fifo", "dir", "missing", "dev-zero"), password
