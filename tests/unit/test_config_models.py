"""Swap mode's configuration: [[models]] and [swap], their errors, and each model's engine as its own Config."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from r3090d import argv as argvmod
from r3090d import config as configmod
from r3090d import exitcodes
from r3090d.config import ConfigError, EngineKind, EngineListen, SwapConfig
from r3090d.config.models import engine_configs, engine_port, model_dir_name

REPO = Path(__file__).resolve().parents[2]
CTL = [sys.executable, "-c", "from r3090d.cli import ctl_main; ctl_main()"]


def swap_doc(**sections) -> dict:
    """Two models (a chat and an embedding) behind the router; each given section's keys laid over."""
    data = {
        "profile": "none",
        "engine": {"python": sys.executable, "port": 8000, "env": {"SHARED": "1", "OVERRIDDEN": "engine"}},
        "gpu": {"required": False},
        "daemon": {"state_dir": "/var/lib/r3090d"},
        "models": [
            {"name": "chat", "model": "/srv/models/chat", "extra_args": ["--enforce-eager"], "env": {"OVERRIDDEN": "chat"}},
            {"name": "embed", "model": "/srv/models/embed", "kind": "embed", "profile": "batch"},
        ],
    }
    for name, table in sections.items():
        if isinstance(table, dict) and isinstance(data.get(name), dict):
            data[name] = {**data[name], **table}
        else:
            data[name] = table
    return data


def load(data: dict, instance: int | None = None) -> configmod.Config:
    return configmod.from_dict(data, "r3090d.toml", instance, check_files=False)


def refused(data, *, key: str, problem: str = "", fix: str = "", instance=None) -> str:
    with pytest.raises(ConfigError) as err:
        configmod.from_dict(data, "r3090d.toml", instance, check_files=False)
    line = err.value.one_line()
    assert err.value.key == key, line
    assert line.startswith(f"r3090d.toml: {key}: "), line
    assert problem in line, line
    assert f"(fix: {fix}" in line and "\n" not in line, line
    return line


def with_model(index: int, **keys) -> list[dict]:
    """swap_doc()'s models, with keys laid over entry `index` (None removes a key)."""
    models = copy.deepcopy(swap_doc()["models"])
    models[index].update(keys)
    models[index] = {k: v for k, v in models[index].items() if v is not None}
    return models


# ------------------------------------------------------------------ loading


def test_a_swap_config_loads_from_toml_text_with_its_keys(tmp_path):
    chat, embed = tmp_path / "chat", tmp_path / "embed"
    chat.mkdir()
    embed.mkdir()
    (tmp_path / "chat.key").write_text("sk-chat\n")
    (tmp_path / "router.key").write_text("sk-router\n")
    path = tmp_path / "r3090d.toml"
    path.write_text(textwrap.dedent(f"""
        profile = "none"
        [engine]
        python = "{sys.executable}"
        host = "0.0.0.0"
        port = 8000
        [gpu]
        required = false
        [[models]]
        name = "chat"
        model = "{chat}"
        api_key_file = "{tmp_path / "chat.key"}"
        [[models]]
        name = "Qwen/embed:v1"
        model = "{embed}"
        kind = "embed"
        [swap]
        max_resident = 2
        queue_timeout = 30
        api_key_file = "{tmp_path / "router.key"}"
    """))
    cfg = configmod.load(path)
    assert cfg.swap_mode
    assert [(m.name, m.kind) for m in cfg.models] == [("chat", EngineKind.GENERATE), ("Qwen/embed:v1", EngineKind.EMBED)]
    assert cfg.swap == dataclasses.replace(SwapConfig(), max_resident=2, queue_timeout=30.0, api_key_file=str(tmp_path / "router.key"))
    # The key of what listens at engine.host:engine.port is the router's; each engine has its own.
    assert cfg.api_key == "sk-router"
    assert [m.api_key for m in cfg.models] == ["sk-chat", ""]
    printed = json.dumps(configmod.redacted(cfg))
    assert "sk-chat" not in printed and "sk-router" not in printed
    assert configmod.redacted(cfg)["models"][1]["kind"] == "embed"  # a value, not an enum's repr
    assert "sk-chat" not in repr(cfg) and "sk-router" not in repr(cfg)


def test_an_engine_key_file_is_read_and_named_in_its_error(tmp_path):
    (tmp_path / "empty.key").write_text("\n")
    data = swap_doc(models=with_model(1, api_key_file=str(tmp_path / "empty.key")))
    data["models"][0]["model"] = data["models"][1]["model"] = str(tmp_path)
    with pytest.raises(ConfigError) as err:
        configmod.from_dict(data, "r3090d.toml")
    assert err.value.key == "models[1].api_key_file" and "is empty" in err.value.problem


def test_without_models_nothing_changes():
    cfg = load({"profile": "none", "engine": {"model": "m"}, "gpu": {"required": False}})
    assert not cfg.swap_mode and cfg.models == () and cfg.swap == SwapConfig()
    assert cfg.engine.kind is EngineKind.GENERATE and cfg.canary.enabled
    assert engine_configs(cfg) == {}


def test_a_single_embedding_engine_gets_no_canary():
    cfg = load({"profile": "none", "engine": {"model": "m", "kind": "embed"}, "gpu": {"required": False}})
    assert cfg.engine.kind is EngineKind.EMBED and not cfg.canary.enabled
    refused({"engine": {"model": "m", "kind": "embed"}, "gpu": {"required": False}, "canary": {"enabled": True}},
            key="canary.enabled", problem="no engine is generative", fix="remove it")  # fmt: skip


def test_a_single_model_in_swap_mode_is_allowed():
    cfg = load(swap_doc(models=[{"name": "only", "model": "/m"}]))
    assert list(engine_configs(cfg)) == ["only"]


# ------------------------------------------------------------ derived engines


def test_each_model_becomes_a_single_engine_config():
    cfg = load(swap_doc(daemon={"exporter_enabled": True}))
    engines = engine_configs(cfg)
    assert list(engines) == ["chat", "embed"]  # the file's order
    chat, embed = engines["chat"], engines["embed"]

    assert chat.engine.model == "/srv/models/chat" and chat.engine.served_model_name == "chat" and chat.model_name == "chat"
    assert chat.engine.extra_args == ["--enforce-eager"] and chat.engine.kind is EngineKind.GENERATE
    assert chat.engine.env == {"SHARED": "1", "OVERRIDDEN": "chat"}  # the entry's env over engine.env
    assert chat.engine.python == cfg.engine.python and chat.engine.startup_timeout == cfg.engine.startup_timeout
    # Each engine serves on its own unix socket in runtime_dir (swap mode's default): no port, no host in its URL.
    assert chat.engine.listen is EngineListen.UDS and chat.engine.uds == "/run/r3090d/engines/0.sock"
    assert chat.engine_url == "http://localhost" and chat.engine_address == "unix:/run/r3090d/engines/0.sock"
    assert chat.profile == "none" and chat.active_profile is None  # the top-level profile
    assert chat.canary.enabled and chat.daemon.state_dir == "/var/lib/r3090d/models/chat"

    assert embed.engine.kind is EngineKind.EMBED and embed.engine.env == {"SHARED": "1", "OVERRIDDEN": "engine"}
    assert embed.engine.uds == "/run/r3090d/engines/1.sock" and embed.engine.extra_args == []
    assert embed.profile == "batch" and embed.active_profile == configmod.BUILTIN_PROFILES["batch"]
    assert not embed.canary.enabled  # an embedding engine refuses the canary's completion

    for engine in engines.values():
        assert not engine.swap_mode and engine.models == () and engine.swap == SwapConfig()
        assert not engine.daemon.exporter_enabled  # the node's one exporter is the daemon's
        assert engine.daemon.runtime_dir == cfg.daemon.runtime_dir and engine.watchdog == cfg.watchdog
    assert cfg.engine.port == 8000 and cfg.engine.model == ""  # the shared Config is left as it was
    assert cfg.engine.uds == "" and cfg.engine_url == "http://127.0.0.1:8000"  # the router's address stays TCP


def test_engines_on_tcp_get_their_ports_when_the_file_asks():
    engines = engine_configs(load(swap_doc(engine={"listen": "tcp"})))
    chat, embed = engines["chat"], engines["embed"]
    assert chat.engine.listen is EngineListen.TCP and chat.engine.uds == "" and embed.engine.uds == ""
    assert (chat.engine.host, chat.engine.port) == ("127.0.0.1", 18100) and chat.engine_url == "http://127.0.0.1:18100"
    assert embed.engine.port == 18101 and embed.engine_address == "http://127.0.0.1:18101"


@pytest.mark.parametrize("instance, runtime, sockets", [
    (None, "/run/r3090d", ["/run/r3090d/engines/0.sock", "/run/r3090d/engines/1.sock"]),
    (3, "/run/r3090d", ["/run/r3090d/3/engines/0.sock", "/run/r3090d/3/engines/1.sock"]),
    (None, "build/run", ["build/run/engines/0.sock", "build/run/engines/1.sock"]),
])  # fmt: skip
def test_each_engines_socket_is_in_its_instances_runtime_dir(instance, runtime, sockets):
    cfg = load(swap_doc(daemon={"runtime_dir": runtime}), instance)
    assert [e.engine.uds for e in engine_configs(cfg).values()] == sockets


def test_a_runtime_dir_too_long_for_the_engines_sockets_is_one_line():
    fits = "/" + "r" * (107 - len("/engines/1.sock") - 1)  # the last engine's socket: exactly 107 bytes
    assert len(engine_configs(load(swap_doc(daemon={"runtime_dir": fits})))["embed"].engine.uds) == 107
    refused(swap_doc(daemon={"runtime_dir": fits + "r"}), key="daemon.runtime_dir", problem="too long for a unix socket (",
            fix="shorten daemon.runtime_dir by 1 bytes or more")  # fmt: skip
    # On TCP the engines have no socket, and the same directory is fine.
    load(swap_doc(engine={"listen": "tcp"}, daemon={"runtime_dir": fits + "r"}))


def test_uds_in_a_models_extra_args_is_refused():
    models = copy.deepcopy(swap_doc()["models"])
    models[0]["extra_args"] = ["--uds", "/tmp/x.sock"]
    refused(swap_doc(models=models), key="models[0].extra_args[0]", problem="--uds is set by r3090d", fix="remove it: each engine serves")


def test_a_canary_switched_off_stays_off_for_every_engine():
    engines = engine_configs(load(swap_doc(canary={"enabled": False})))
    assert not any(e.canary.enabled for e in engines.values())


def test_each_engine_gets_its_own_key(tmp_path):
    keys = []
    for name in ("chat", "embed"):
        (tmp_path / f"{name}.key").write_text(f"sk-{name}\n")
        keys.append(str(tmp_path / f"{name}.key"))
    data = swap_doc(models=[{**m, "model": str(tmp_path), "api_key_file": k} for m, k in zip(swap_doc()["models"], keys, strict=True)])
    engines = engine_configs(configmod.from_dict(data, "r3090d.toml"))
    assert {n: (e.api_key, e.engine.api_key_file) for n, e in engines.items()} == {
        "chat": ("sk-chat", keys[0]),
        "embed": ("sk-embed", keys[1]),
    }


def test_an_engine_config_builds_the_single_engine_command_line_and_environment():
    cfg = load(swap_doc())
    chat = dataclasses.replace(engine_configs(cfg)["chat"], api_key="sk-chat")
    argv = argvmod.build_argv(chat, argvmod.parse_version("0.32.0"))
    assert argv[argv.index("--model") + 1] == "/srv/models/chat"
    assert argv[argv.index("--served-model-name") + 1] == "chat"
    # vLLM ignores --host and --port with --uds: they are not passed, so ps shows no port.
    assert argv[argv.index("--uds") + 1] == "/run/r3090d/engines/0.sock" and "--port" not in argv and "--host" not in argv
    assert argv[-1] == "--enforce-eager" and "sk-chat" not in " ".join(argv)
    env = argvmod.engine_env(chat, {"PATH": "/bin"})
    assert env["VLLM_API_KEY"] == "sk-chat" and env["SHARED"] == "1" and env["OVERRIDDEN"] == "chat"

    on_tcp = argvmod.build_argv(engine_configs(load(swap_doc(engine={"listen": "tcp"})))["chat"], argvmod.parse_version("0.32.0"))
    assert on_tcp[on_tcp.index("--host") + 1] == "127.0.0.1" and on_tcp[on_tcp.index("--port") + 1] == "18100"
    assert "--uds" not in on_tcp


def test_a_vllm_without_uds_is_a_config_error_naming_engine_listen():
    chat = engine_configs(load(swap_doc()))["chat"]
    with pytest.raises(ConfigError) as err:
        argvmod.build_argv(chat, argvmod.parse_version("0.8.5"))
    assert err.value.key == "engine.listen" and "--uds needs vLLM >= 0.9.0rc1" in err.value.one_line()


@pytest.mark.parametrize("instance, ports", [(None, [18100, 18101]), (0, [18100, 18101]), (3, [18400, 18401]), (63, [24400, 24401])])
def test_engine_ports_are_a_block_per_instance(instance, ports):
    cfg = load(swap_doc(), instance)
    assert [engine_port(cfg, i) for i in range(2)] == ports
    assert [e.engine.port for e in engine_configs(cfg).values()] == ports
    assert cfg.engine.port == 8000 + (instance or 0)  # the router's public port, as a single engine's
    if instance is not None:
        assert engine_configs(cfg)["chat"].daemon.state_dir == f"/var/lib/r3090d/{instance}/models/chat"


def test_engine_port_base_moves_the_block():
    cfg = load(swap_doc(swap={"engine_port_base": 30000}), 2)
    assert [engine_port(cfg, i) for i in range(2)] == [30200, 30201]


@pytest.mark.parametrize(
    "name, directory",
    [("chat", "chat"), ("Qwen/Qwen2.5-7B-Instruct", "Qwen%2FQwen2.5-7B-Instruct"), ("llama3:8b", "llama3%3A8b"), ("a.b_c-d", "a.b_c-d")],
)
def test_a_served_name_is_one_path_component(name, directory):
    assert model_dir_name(name) == directory and "/" not in directory
    cfg = load(swap_doc(models=with_model(0, name=name)))
    assert engine_configs(cfg)[name].daemon.state_dir == f"/var/lib/r3090d/models/{directory}"


# ------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "models, key, problem, fix",
    [
        (with_model(1, nmae="x"), "models[1].nmae", "unknown key", "did you mean models[1].name?"),
        (with_model(0, api_key="sk-in-the-file"), "models[0].api_key", "unknown key", "did you mean models[0].api_key_file?"),
        (with_model(0, name=None), "models[0].name", "is required", 'set it to the name clients send as "model"'),
        (with_model(1, name="chat"), "models[1].name", "'chat' is also models[0].name", "give each model its own name"),
        (with_model(0, name="has space"), "models[0].name", "is not a model name", "use 1 to 128 letters"),
        (with_model(0, name=".."), "models[0].name", "is not a model name", "use 1 to 128"),
        (with_model(0, name="x" * 129), "models[0].name", "over the limit of 128", "shorten it"),
        (with_model(0, name=":" * 100), "models[0].name", "too long as a directory name", "shorten it"),
        (with_model(0, model=None), "models[0].model", "is required", "set it to the model directory"),
        (with_model(0, kind="chat"), "models[0].kind", "'chat' is not one of 'generate', 'embed'", "use one of generate, embed"),
        (with_model(0, kind=1), "models[0].kind", "1 is not one of", "use one of generate, embed"),
        (with_model(0, profile="fast"), "models[0].profile", "unknown profile 'fast'", "use one of batch, realtime"),
        (with_model(0, extra_args=["--port", "9"]), "models[0].extra_args[0]", "--port is set by r3090d", "remove it: each engine gets its own port"),
        (with_model(0, extra_args=["--served-model-name=x"]), "models[0].extra_args[0]", "is set by r3090d", "use models[0].name instead"),
        (with_model(0, extra_args=["--api-key", "k"]), "models[0].extra_args[0]", "is set by r3090d", "use models[0].api_key_file instead"),
        (with_model(1, extra_args=["--max-num-seqs", "8"]), "models[1].extra_args[0]", "set by profile 'batch'", 'change the profile in [profiles.NAME], or set models[1].profile = "none"'),
        (with_model(1, extra_args=["--runner", "generate"]), "models[1].extra_args[0]", "--runner generate contradicts models[1].kind = 'embed'", "use --runner pooling"),
        (with_model(0, extra_args=["--runner=pooling"]), "models[0].extra_args[0]", "contradicts models[0].kind = 'generate'", "use --runner generate"),
        (with_model(0, env={"VLLM_API_KEY": "k"}), "models[0].env.VLLM_API_KEY", "is managed by r3090d", "remove it"),
        (with_model(0, env={"A=B": "k"}), 'models[0].env."A=B"', "is not an environment variable name", "use a name such as MY_VAR"),
        (with_model(0, env={"BIG": "x" * 40000, "BIGGER": "x" * 40000}), "models[0].env", "exceed the 65536-byte budget", "pass long values through files"),
        ("chat", "models", "expected an array of tables, got str", "write each entry as [[models]]"),
        (["chat"], "models[0]", "expected a table, got str", "write each entry as [[models]]"),
    ],
)  # fmt: skip
def test_a_wrong_model_entry_is_one_line_naming_it(models, key, problem, fix):
    refused(swap_doc(models=models), key=key, problem=problem, fix=fix)


@pytest.mark.parametrize(
    "engine_key, fix",
    [
        ("model", "move it into a [[models]] entry"),
        ("served_model_name", "move it into a [[models]] entry as its name"),
        ("extra_args", "move it into the [[models]] entries"),
        ("kind", "set kind in each [[models]] entry"),
        ("api_key_file", "set swap.api_key_file for the router's key"),
    ],
)
def test_one_models_engine_keys_are_refused_in_swap_mode(engine_key, fix):
    value = {"model": "/m", "served_model_name": "x", "extra_args": [], "kind": "generate", "api_key_file": "/k"}[engine_key]
    refused(swap_doc(engine={engine_key: value}), key=f"engine.{engine_key}", problem="[[models]] lists the models", fix=fix)


@pytest.mark.parametrize(
    "swap, key, problem, fix",
    [
        ({"max_resident": 3}, "swap.max_resident", "is 3 but only 2 models are listed", "set it to at most 2"),
        ({"max_resident": 0}, "swap.max_resident", "out of range", "use a value from 1 to 16"),
        ({"queue_timeout": 0.5}, "swap.queue_timeout", "out of range", "use a value from 1 to 3600"),
        ({"min_residency": -1}, "swap.min_residency", "out of range", "use a value from 0 to 86400"),
        ({"drain_timeout": 3601}, "swap.drain_timeout", "out of range", "use a value from 0 to 3600"),
        ({"max_body_mib": 0}, "swap.max_body_mib", "out of range", "use a value from 1"),
        ({"quue_timeout": 5}, "swap.quue_timeout", "unknown key", "did you mean swap.queue_timeout?"),
        ({"host_memory_budget_mib": "8G"}, "swap.host_memory_budget_mib", "expected an integer", "write host_memory_budget_mib = <an integer>"),
    ],
)  # fmt: skip
def test_a_wrong_swap_key_is_one_line(swap, key, problem, fix):
    refused(swap_doc(swap=swap), key=key, problem=problem, fix=fix)


def test_swap_without_models_is_refused():
    refused({"engine": {"model": "m"}, "gpu": {"required": False}, "swap": {"max_resident": 1}},
            key="swap", problem="no [[models]] entry", fix="add [[models]] entries")  # fmt: skip


def test_the_public_address_needs_the_routers_key_when_not_loopback():
    refused(swap_doc(engine={"host": "0.0.0.0"}), key="engine.host", problem="swap.api_key_file is empty", fix="set swap.api_key_file")
    assert load(swap_doc(engine={"host": "0.0.0.0"}, swap={"api_key_file": "/etc/r3090d/router.key"})).engine.host == "0.0.0.0"


def test_an_unused_top_level_profile_must_still_exist():
    models = [{**m, "profile": "batch"} for m in swap_doc()["models"]]
    refused(swap_doc(profile="fast", models=models), key="profile", problem="unknown profile 'fast'", fix="use one of")


def test_a_models_profile_is_held_to_the_memory_alert():
    data = swap_doc(gpu={"required": True}, profiles={"big": {"gpu_memory_utilization": 0.97}}, models=with_model(0, profile="big"))
    refused(data, key="profiles.big.gpu_memory_utilization", problem="the memory alert would fire forever", fix="lower gpu_memory_utilization")


def test_no_canary_without_a_generative_model():
    embed_only = [{"name": "e", "model": "/m", "kind": "embed"}]
    assert not load(swap_doc(models=embed_only)).canary.enabled
    refused(swap_doc(models=embed_only, canary={"enabled": True}), key="canary.enabled", problem="no engine is generative", fix="remove it")


# -------------------------------------------------------------------- ports


@pytest.mark.parametrize(
    "sections, instance, problem, fix",
    [
        # Instance 0's engines on 8010, 8011: r3090d@10's public port is 8010.
        ({"swap": {"engine_port_base": 8010}}, None, "engine port 8010 (models[0], 'chat', r3090d@0) is among the ports engine.port takes (8000-8063",
         "move swap.engine_port_base clear of 8000-8063"),
        ({"swap": {"engine_port_base": 9330}}, 1, "engine port 9430 (models[0], 'chat', r3090d@1) is among the ports daemon.exporter_port takes (9400-9463",
         "move swap.engine_port_base clear of 9400-9463"),
        ({"swap": {"engine_port_base": 7999}}, None, "engine port 8000 (models[1], 'embed', r3090d@0)", "move swap.engine_port_base"),
        ({"swap": {"engine_port_base": 59235}}, 63, "the engine ports of r3090d@63 (59235 + 100 x 63 + 0..1) end at 65536, above 65535",
         "set swap.engine_port_base to at most 59234"),
    ],
)  # fmt: skip
def test_engine_ports_are_checked_against_every_instances_ports(sections, instance, problem, fix):
    on_tcp = swap_doc(**sections)
    on_tcp["engine"] = {**on_tcp["engine"], "listen": "tcp"}
    refused(on_tcp, key="swap.engine_port_base", problem=problem, fix=fix, instance=instance)
    # On unix sockets (the default) the engines use no port: nothing to clash.
    assert load(swap_doc(**sections), instance).engine.listen is EngineListen.UDS


def test_the_exporters_ports_are_free_for_engines_when_it_is_off():
    cfg = load(swap_doc(swap={"engine_port_base": 9400}, daemon={"exporter_enabled": False}))
    assert engine_port(cfg, 0) == 9400
    assert load(swap_doc(swap={"engine_port_base": 59234}), 63) is not None  # the last port that fits


def test_an_instance_has_a_hundred_engine_ports():
    models = [{"name": f"m{i}", "model": "/m"} for i in range(101)]
    refused(swap_doc(models=models), key="models", problem="lists 101 models, more than the 100 engine ports", fix="keep at most 100")
    assert len(engine_configs(load(swap_doc(models=models[:100])))) == 100


# --------------------------------------------------------- the shipped config


def test_the_shipped_swap_example_loads_once_uncommented(tmp_path):
    text = (REPO / "etc" / "r3090d.toml").read_text()
    start = text.index("# [[models]]\n")
    block = [line[2:] for line in text[start:].splitlines() if re.match(r"# (\[|[a-z_]+ = )", line)]
    example = tmp_path / "swap.toml"
    example.write_text(f'[engine]\npython = "{sys.executable}"\n[gpu]\nrequired = false\n' + "\n".join(block) + "\n")
    cfg = configmod.load(example, check_files=False)
    assert [(m.name, m.kind) for m in cfg.models] == [("chat", EngineKind.GENERATE), ("embed", EngineKind.EMBED)]
    assert cfg.swap == SwapConfig()  # every [swap] key shown with its default


def test_the_shipped_engine_kind_is_the_default():
    assert configmod.load(REPO / "etc" / "r3090d.toml", check_files=False).engine == configmod.EngineConfig(
        model="/srv/models/Qwen2.5-7B-Instruct"
    )


# ------------------------------------------------------------- config check


def write_swap_config(tmp_path: Path, engine_python: str, **sections) -> Path:
    data = swap_doc(engine={"python": engine_python}, **sections)
    for i, entry in enumerate(data["models"]):
        model = tmp_path / f"model{i}"
        model.mkdir(exist_ok=True)
        entry["model"] = str(model)
    path = tmp_path / "r3090d.toml"
    lines = ['profile = "none"', "[engine]", f'python = "{engine_python}"', "port = 8000", "[gpu]", "required = false", "[daemon]",
             f'runtime_dir = "{tmp_path / "run"}"']  # fmt: skip
    for entry in data["models"]:
        lines.append("[[models]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items() if k != "env"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_config_check_shows_every_models_engine(tmp_path, fake_engine_python):
    path = write_swap_config(tmp_path, fake_engine_python)
    done = subprocess.run([*CTL, "config", "check", "--config", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    run = str(tmp_path / "run")
    assert "models: 2, served by the router on 127.0.0.1:8000" in done.stdout
    assert re.search(rf"^  chat +generate +unix:{re.escape(run)}/engines/0\.sock +profile none +\S+model0$", done.stdout, re.M), done.stdout
    assert re.search(rf"^  embed +embed +unix:{re.escape(run)}/engines/1\.sock +profile batch +\S+model1$", done.stdout, re.M), done.stdout
    assert "argv chat: " in done.stdout and f"--served-model-name chat --uds {run}/engines/0.sock" in done.stdout
    assert f"--served-model-name embed --uds {run}/engines/1.sock" in done.stdout

    # The file as an argument, as well as with --config.
    done = subprocess.run([*CTL, "config", "check", "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["argv"] is None
    assert [(e["name"], e["kind"], e["model"], e["listen"], e["socket"], e["port"], e["profile"]) for e in out["engines"]] == [
        ("chat", "generate", str(tmp_path / "model0"), "uds", f"{run}/engines/0.sock", None, "none"),
        ("embed", "embed", str(tmp_path / "model1"), "uds", f"{run}/engines/1.sock", None, "batch"),
    ]
    for engine in out["engines"]:
        assert engine["argv"][engine["argv"].index("--uds") + 1] == engine["socket"]
        assert "--port" not in engine["argv"] and "--host" not in engine["argv"]
    assert out["config"]["models"][1]["kind"] == "embed" and out["config"]["engine"]["listen"] == "uds"


def test_config_check_shows_engine_ports_when_the_file_asks_for_tcp(tmp_path, fake_engine_python):
    path = write_swap_config(tmp_path, fake_engine_python)
    path.write_text(path.read_text().replace("[engine]\n", '[engine]\nlisten = "tcp"\n', 1))
    done = subprocess.run([*CTL, "config", "check", "--json", "--config", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [(e["listen"], e["host"], e["port"], e["socket"]) for e in out["engines"]] == [("tcp", "127.0.0.1", 18100, None),
                                                                                        ("tcp", "127.0.0.1", 18101, None)]  # fmt: skip
    assert out["engines"][1]["argv"][out["engines"][1]["argv"].index("--port") + 1] == "18101" and "--uds" not in out["engines"][1]["argv"]


def test_config_check_refuses_two_different_files(tmp_path, fake_engine_python):
    path = write_swap_config(tmp_path, fake_engine_python)
    done = subprocess.run([*CTL, "config", "check", "--config", str(path), str(tmp_path / "other.toml")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == exitcodes.USAGE and "two config files given" in done.stderr


def test_config_check_names_the_model_entry_of_an_error(tmp_path, fake_engine_python):
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 4096}
    path = write_swap_config(tmp_path, fake_engine_python, models=with_model(1, profile=None, extra_args=["--max-model-len", "8192"]))
    (tmp_path / "model1" / "config.json").write_text(json.dumps(llama))
    done = subprocess.run([*CTL, "config", "check", "--config", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == exitcodes.CONFIG, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert f"{path}: models[1].extra_args[0]: --max-model-len 8192 is above the model's context limit of 4096" in done.stderr


# ------------------------------------------------------------------ park


def test_park_defaults_to_auto_and_sleep_adds_the_flag_and_dev_mode_only_where_asked():
    plain = engine_configs(load(swap_doc()))
    assert {c.park_mode for c in plain.values()} == {configmod.schema.ParkMode.AUTO}
    for c in plain.values():
        assert argvmod.SLEEP_MODE_FLAG not in argvmod.build_argv(c, argvmod.parse_version("0.32.0"))
        assert argvmod.SLEEP_ENV not in argvmod.engine_env(c, {})
    data = swap_doc(swap={"sleep_timeout": 30}, gpu={"required": True})
    data["models"][0]["park"] = "sleep"
    data["models"][1]["park"] = "stop"
    by_name = engine_configs(load(data))
    chat, embed = by_name["chat"], by_name["embed"]
    assert (chat.park_mode.value, embed.park_mode.value) == ("sleep", "stop")
    assert chat.swap.sleep_timeout == 30.0
    assert argvmod.build_argv(chat, argvmod.parse_version("0.32.0")).count(argvmod.SLEEP_MODE_FLAG) == 1
    assert argvmod.engine_env(chat, {})[argvmod.SLEEP_ENV] == "1"
    assert argvmod.SLEEP_MODE_FLAG not in argvmod.build_argv(embed, argvmod.parse_version("0.32.0"))
    assert chat.engine.host == "127.0.0.1"  # the dev endpoints never on the public address


@pytest.mark.parametrize(
    ("change", "key", "problem", "fix"),
    [
        ({"park": "nap"}, "models[0].park", "'nap' is not one of", "use one of auto, sleep, checkpoint, stop"),
        ({"park": "sleep", "kind": "embed"}, "models[0].park", "the canary that checks each wake", 'set models[0].park = "auto"'),
    ],
)
def test_a_wrong_park_is_one_line(change, key, problem, fix):
    data = swap_doc(gpu={"required": True})
    data["models"][0].update(change)
    refused(data, key=key, problem=problem, fix=fix)


def test_park_by_sleep_needs_the_canary_and_a_gpu():
    data = swap_doc(canary={"enabled": False}, gpu={"required": True})
    data["models"][0]["park"] = "sleep"
    refused(data, key="models[0].park", problem="canary.enabled is false", fix="set canary.enabled = true")
    data = swap_doc()  # gpu.required = false
    data["models"][0]["park"] = "sleep"
    refused(data, key="models[0].park", problem="gpu.required is false", fix='set models[0].park = "auto"')


def test_a_wrong_sleep_timeout_is_one_line():
    refused(swap_doc(swap={"sleep_timeout": 0}), key="swap.sleep_timeout", fix="")
