"""The example Kubernetes manifests agree with the daemon: its config schema, defaults, ports and shutdown."""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path, PurePosixPath

import pytest

from r3090d import argv as argvmod
from r3090d import config
from r3090d.config import Config
from r3090d.core.vocabulary import Phase
from r3090d.effectors.child import DRAIN_MARGIN_S
from r3090d.service.exporter import Exporter
from r3090d.service.httpserver import HttpRequest, Method

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "etc" / "k8s"
RULES = ROOT / "etc" / "prometheus-rules.yml"
CONFIG_KEY = "r3090d.toml"
# After the kubelet marks a pod not ready, the endpoint change still has to
# reach every node's proxy; lb_grace must leave at least this for it.
ENDPOINT_PROPAGATION_S = 3.0
SECRET_ENV = re.compile(r"KEY|PASSWORD|SECRET|TOKEN", re.IGNORECASE)


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def only(kind: str) -> dict:
    found = [doc for _, doc in documents() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in etc/k8s, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def deployment() -> dict:
    return only("Deployment")


@pytest.fixture(scope="module")
def pod(deployment) -> dict:
    return deployment["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (c,) = [c for c in pod["containers"] if c["name"] == "r3090d"]
    return c


@pytest.fixture(scope="module")
def cfg() -> Config:
    """The ConfigMap's r3090d.toml, through the daemon's own loader (files are not there to check)."""
    try:
        data = tomllib.loads(only("ConfigMap")["data"][CONFIG_KEY])
        return config.from_dict(data, "etc/k8s/configmap.yaml", check_files=False)
    except (tomllib.TOMLDecodeError, config.ConfigError) as exc:
        pytest.fail(f"etc/k8s/configmap.yaml, {CONFIG_KEY}: {exc}", pytrace=False)


def port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port in named, f"port {port!r} is not a named container port ({sorted(named)})"
    return named[port]


def mounts(container: dict, pod: dict) -> dict[str, tuple[dict, dict]]:
    """mountPath -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container["volumeMounts"]}


def mount_of(path: str, container: dict, pod: dict) -> tuple[str, dict, dict] | None:
    """The deepest volume mount holding `path`: (mountPath, volumeMount, volume)."""
    best = None
    for mount_path, (m, v) in mounts(container, pod).items():
        if PurePosixPath(path).is_relative_to(mount_path) and (best is None or len(mount_path) > len(best[0])):
            best = (mount_path, m, v)
    return best


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_every_document_is_a_known_kind_with_a_name():
    kinds = sorted(doc["kind"] for _, doc in documents())
    assert kinds == sorted(["ConfigMap", "Deployment", "PersistentVolumeClaim", "PersistentVolumeClaim", "PodMonitor", "Service"])
    for name, doc in documents():
        assert doc.get("apiVersion"), f"{name}: {doc['kind']} has no apiVersion"
        assert doc["metadata"].get("name"), f"{name}: {doc['kind']} has no metadata.name"
        assert "namespace" not in doc["metadata"], f"{name}: leave the namespace to kubectl -n"


def test_the_configmap_is_a_valid_container_config(cfg):
    assert cfg.daemon.exporter_enabled, "the probes and the PodMonitor need the exporter"
    assert cfg.daemon.exporter_host == "0.0.0.0", "the kubelet probes from outside the pod"
    assert not cfg.alerts.syslog.enabled, "a container has no /dev/log"
    assert cfg.gpu.index == 0, "the device plugin shows the container its one GPU as index 0"
    assert cfg.daemon.exit_on_give_up is False, "the README and comments choose staying up after a give-up"


def test_the_config_is_mounted_where_the_daemon_looks(container, pod):
    found = mount_of(str(config.DEFAULT_PATH), container, pod)
    assert found is not None, f"nothing is mounted at {config.DEFAULT_PATH}"
    mount_path, m, volume = found
    assert mount_path == str(config.DEFAULT_PATH.parent), "mount the directory: a subPath mount never sees a ConfigMap edit"
    assert "subPath" not in m
    assert volume["configMap"]["name"] == only("ConfigMap")["metadata"]["name"]
    assert config.ENV_CONFIG not in env(container)


def test_rolling_update_is_never_used(deployment):
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1


def test_one_gpu(container):
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "compute" in env(container)["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert "utility" in env(container)["NVIDIA_DRIVER_CAPABILITIES"].split(","), "NVML needs the utility capability"


def test_ports_match_the_config(container, cfg):
    assert port_number(container, "metrics") == cfg.daemon.exporter_port
    assert port_number(container, "http") == cfg.engine.port
    # The shipped defaults, so the Service reads the same on a host or in a pod.
    assert cfg.daemon.exporter_port == config.DaemonConfig().exporter_port
    assert cfg.engine.port == config.EngineConfig().port


@pytest.mark.parametrize(
    ("probe", "path"), [("readinessProbe", "/healthz"), ("livenessProbe", "/livez"), ("startupProbe", "/livez")]
)
def test_probes_ask_the_exporter(container, cfg, probe, path):
    get = container[probe]["httpGet"]
    assert get["path"] == path
    assert port_number(container, get["port"]) == cfg.daemon.exporter_port
    assert container[probe].get("successThreshold", 1) == 1


@pytest.mark.parametrize("probe", ["readinessProbe", "livenessProbe", "startupProbe"])
def test_the_exporter_serves_each_probe_path(container, probe):
    """A fresh state document with a ready engine: every probe path answers 200 (an unknown path is 404)."""
    now = 1000.0
    doc = {"written_at": now, "daemon": {"poll_interval": 2.0}, "engine": {"phase": Phase.READY.value}, "health": {"status": "ok"}}
    exporter = Exporter("127.0.0.1", 0, lambda: doc, clock=lambda: now)  # never started: no socket
    reply = exporter.respond(HttpRequest(Method.GET, container[probe]["httpGet"]["path"], None))
    assert reply.code == 200, reply.body


def probe_budget(probe: dict) -> float:
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_startup_probe_outlasts_the_daemon_start(container, cfg):
    """/livez answers once the loop runs: after the engine version probe and preflight's transient wait."""
    version_timeout = inspect.signature(argvmod.engine_version).parameters["timeout"].default
    before_exporter = version_timeout + cfg.preflight.transient_give_up_s
    startup = container["startupProbe"]
    assert probe_budget(startup) >= before_exporter + startup["periodSeconds"], (
        "the kubelet would kill a daemon that preflight is still holding; let the daemon exit 75 itself"
    )
    assert config.PreflightConfig().transient_give_up_s <= cfg.preflight.transient_give_up_s


def test_lb_grace_covers_readiness_and_endpoint_propagation(container, cfg):
    readiness = container["readinessProbe"]
    assert cfg.watchdog.lb_grace >= probe_budget(readiness) + ENDPOINT_PROPAGATION_S, (
        "vLLM would get its SIGTERM while the Service still sends it requests"
    )


def test_termination_grace_covers_the_drain(pod, cfg):
    grace = pod["terminationGracePeriodSeconds"]
    for source, c in (("the ConfigMap", cfg), ("the defaults", Config())):
        need = c.engine.shutdown_timeout + c.watchdog.lb_grace + DRAIN_MARGIN_S
        assert grace >= need, f"with {source}, the kubelet SIGKILLs vLLM while r3090d drains it ({grace} < {need})"
    assert config.WatchdogConfig().lb_grace <= cfg.watchdog.lb_grace


def test_tini_forwards_signals_to_the_daemon_alone(container):
    command = container["command"]
    assert PurePosixPath(command[0]).name == "tini"
    assert "-g" not in command[: command.index("--")], "-g would SIGTERM the whole group, not let r3090d drain vLLM"
    assert PurePosixPath(command[command.index("--") + 1]).name == "r3090d"
    assert "args" not in container


def test_secrets_are_files_named_by_the_config(container, pod, cfg):
    password_file = cfg.alerts.email.password_file
    for key, path in (("engine.api_key_file", cfg.engine.api_key_file), ("alerts.email.password_file", password_file)):
        assert path, f"{key} is empty"
        found = mount_of(path, container, pod)
        assert found is not None, f"{key} {path} is on no volume"
        mount_path, m, volume = found
        assert "secret" in volume, f"{key} {path} is not on a Secret volume"
        assert m.get("readOnly") is True
        relative = str(PurePosixPath(path).relative_to(mount_path))
        items = volume["secret"].get("items")
        assert items is None or relative in {i["path"] for i in items}, f"{key}: the Secret volume has no {relative}"
        assert volume["secret"]["defaultMode"] & 0o007 == 0, "others must not read a secret"
    for e in container.get("env", []):
        assert "valueFrom" not in e, f"env {e['name']}: secrets travel as files, never in the environment"
        assert not SECRET_ENV.search(e["name"]), f"env {e['name']} looks like a secret"
    argv = " ".join(container["command"] + container.get("args", []))
    assert "secret" not in argv.lower()


def test_daemon_directories_are_below_emptydirs(container, pod, cfg):
    """An emptyDir's root is world-writable, which r3090d refuses: use a directory it creates inside."""
    for key, path in (("daemon.state_dir", cfg.daemon.state_dir), ("daemon.runtime_dir", cfg.daemon.runtime_dir)):
        found = mount_of(path, container, pod)
        assert found is not None, f"{key} {path} is on the read-only root filesystem"
        mount_path, _, volume = found
        assert "emptyDir" in volume, f"{key} {path} must be scratch (an emptyDir)"
        assert PurePosixPath(path) != PurePosixPath(mount_path), f"{key} is the emptyDir's root (mode 0777)"


def test_model_and_caches_are_on_persistent_volumes(container, pod, cfg):
    found = mount_of(cfg.engine.model, container, pod)
    assert found is not None and "persistentVolumeClaim" in found[2], "the model must be on a PVC"
    assert found[1].get("readOnly") is True
    e = env(container)
    for name in ("VLLM_CACHE_ROOT", "HOME", "XDG_CACHE_HOME"):
        found = mount_of(e[name], container, pod)
        assert found is not None and "persistentVolumeClaim" in found[2], f"{name} must survive the pod"
        assert not found[1].get("readOnly"), f"{name} must be writable"
    claims = {d["metadata"]["name"] for d in (doc for _, doc in documents()) if d["kind"] == "PersistentVolumeClaim"}
    for v in pod["volumes"]:
        if "persistentVolumeClaim" in v:
            assert v["persistentVolumeClaim"]["claimName"] in claims


def test_writable_paths_exist_with_a_read_only_root(container, pod):
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for name in ("TMPDIR", "HOME"):
        found = mount_of(env(container)[name], container, pod)
        assert found is not None and not found[1].get("readOnly"), f"{name} is not writable"


def test_dev_shm_is_memory(container, pod):
    found = mount_of("/dev/shm", container, pod)
    assert found is not None and found[0] == "/dev/shm"
    assert found[2]["emptyDir"]["medium"] == "Memory"


def test_service_reaches_the_pod_ports(deployment, container):
    service = only("Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(by_name) == {"http", "metrics"}
    for name, p in by_name.items():
        assert port_number(container, p["targetPort"]) == port_number(container, name)
        assert p["port"] == port_number(container, name)


def test_podmonitor_scrapes_the_exporter_as_job_r3090d(deployment, container):
    monitor = only("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert port_number(container, endpoint["port"]) == port_number(container, "metrics")
    assert endpoint.get("path", "/metrics") == "/metrics"
    job = labels[monitor["spec"]["jobLabel"]]
    assert f'job="{job}"' in RULES.read_text(), "etc/prometheus-rules.yml selects another job"
    for r in endpoint.get("relabelings", []):
        for source in r.get("sourceLabels", []):
            m = re.fullmatch(r"__meta_kubernetes_pod_label_(\w+)", source)
            if m:
                assert m.group(1) in {re.sub(r"[^a-zA-Z0-9_]", "_", k) for k in labels}, f"{source}: no such pod label"
