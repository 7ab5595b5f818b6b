"""Secrets: read from their own files (never from the TOML), and kept out of what is printed."""

from __future__ import annotations

import dataclasses
import os
import stat
from enum import Enum
from pathlib import Path

from r3090d.config.errors import ConfigError
from r3090d.config.schema import Config, resolve_profiles

SECRET_MAX_BYTES = 64 * 1024  # an API key or password file; anything bigger is the wrong file


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _require_secret_file(st: os.stat_result, source, key: str, secret_path) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a plain file")
        raise ConfigError(source, key, f"{secret_path} is {kind}, not a regular file", "point it at a plain file holding only the secret")
    if st.st_size > SECRET_MAX_BYTES:
        raise ConfigError(source, key, f"{secret_path} is {st.st_size} bytes, over the {SECRET_MAX_BYTES}-byte limit for a secret", "point it at the file holding only the secret")


def read_secret(source, key: str, secret_path: str | Path) -> str:
    """The text of a secret file (API key, SMTP password), or ConfigError naming the file, never its text.

    Only a regular file of at most SECRET_MAX_BYTES of UTF-8 is read. It is
    stat()ed before it is opened, since opening a device can itself act (and
    /dev/zero never ends), and opened with O_NONBLOCK, since a FIFO swapped in
    after the stat would otherwise wait for a writer for ever.
    """
    fix = "check the file exists and the service user can read it"
    try:
        _require_secret_file(os.stat(secret_path), source, key, secret_path)
        fd = os.open(secret_path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(source, key, f"cannot read {secret_path}: {exc.strerror}", fix) from None
    except ValueError:
        raise ConfigError(source, key, "the path contains a NUL byte", "remove it") from None
    try:
        _require_secret_file(os.fstat(fd), source, key, secret_path)  # the file opened, in case it was swapped
        chunks, size = [], 0
        while size <= SECRET_MAX_BYTES:
            chunk = os.read(fd, SECRET_MAX_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(source, key, f"cannot read {secret_path}: {exc.strerror}", fix) from None
    finally:
        os.close(fd)
    if size > SECRET_MAX_BYTES:
        raise ConfigError(source, key, f"{secret_path} grew over the {SECRET_MAX_BYTES}-byte limit for a secret", "point it at the file holding only the secret")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(source, key, f"{secret_path} is not UTF-8 text", "write the secret as UTF-8 text") from None


def read_api_key(path, secret_path: str, key: str = "engine.api_key_file") -> str:
    """An API key from its file (`key` names the setting), one line, for VLLM_API_KEY or a Bearer header."""
    text = read_secret(path, key, secret_path).strip()
    if not text:
        raise ConfigError(path, key, f"{secret_path} is empty", "write the key into it")
    # It reaches vLLM as VLLM_API_KEY: execve refuses a NUL, and a key of several lines is the wrong file.
    if "\0" in text or "\n" in text or "\r" in text:
        raise ConfigError(path, key, f"{secret_path} holds more than the key (several lines or a NUL byte)", "keep only the key in it")
    return text


def redacted(cfg: Config) -> dict:
    """The effective configuration as plain data, safe to print."""
    data = dataclasses.asdict(cfg, dict_factory=_plain)
    data["api_key"] = "<redacted>" if cfg.api_key else ""
    for entry, model in zip(data["models"], cfg.models, strict=True):
        entry["api_key"] = "<redacted>" if model.api_key else ""
    data["profiles"] = {k: dataclasses.asdict(v) for k, v in resolve_profiles(cfg).items()}
    if not cfg.engine.uds:
        del data["engine"]["uds"]  # derived: the one engine's socket; swap mode's engines are shown one by one
    return data


def _plain(items: list[tuple[str, object]]) -> dict:
    """A section as a dict, an enum member as its value (engine.kind prints as "embed")."""
    return {k: v.value if isinstance(v, Enum) else v for k, v in items}
