"""deploy/: the compose file is valid, its services work as written (run as local processes), the
Kubernetes manifests parse and every pdserve command in them is accepted by the CLI, and the
engines' --health-port endpoint behaves (issue: deployment)."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import REPO
from pd_harness import free_port, wait_until

from server.procs import start_tied

COMPOSE = REPO / "deploy" / "docker-compose.yml"
K8S = REPO / "deploy" / "k8s"
ENGINE_ROLES = ("prefill", "decode", "colocated")


def compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def load_compose() -> dict:
    """The compose file with `${VAR:-default}` resolved to its default, as on a host with no overrides."""
    text = COMPOSE.read_text()
    # An empty default must stay an empty string (`''`), as docker-compose makes it, not YAML's null.
    text = re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "''", text)
    return yaml.safe_load(text)


# -- compose ------------------------------------------------------------------------------------

def test_compose_config_is_valid():
    binary = compose_binary()
    if binary is None:
        if os.environ.get("CI"):  # CI's set-up must have installed it: a skip there would hide the check
            pytest.fail("docker-compose is not installed; `make test` installs Debian's package where apt-get exists")
        pytest.skip("docker-compose is not installed (make's set-up installs it where apt-get exists)")
    r = subprocess.run([*binary, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"docker-compose config -q failed:\n{r.stderr}"


def test_compose_engines_scale_and_have_healthchecks():
    services = {name: svc for name, svc in load_compose()["services"].items()
                if not svc.get("profiles")}  # the optional monitoring profile: tests/test_monitoring.py
    assert set(services) == {"server", "prefill", "decode"}
    for name in ("prefill", "decode"):
        svc = services[name]
        # `--scale` needs replicas that do not collide on a container name or a host port.
        assert "container_name" not in svc and "ports" not in svc, f"{name} cannot be scaled"
        assert "--health-port" in svc["command"] or "PDSERVE_HEALTH_PORT" in svc["environment"]
    for name, svc in services.items():
        assert svc["healthcheck"]["test"][0] == "CMD", name
        assert svc["restart"] in ("always", "unless-stopped", "on-failure"), name
        assert svc["environment"]["PDSERVE_MODEL"] == "/app/models/pdserve-tiny", name


class LocalCompose:
    """The compose services as processes on this host: same commands and environment, with service
    hostnames (and 0.0.0.0) mapped to 127.0.0.1 and every container port mapped to a free local port."""

    def __init__(self, model: str, tmp: Path) -> None:
        self.spec = load_compose()["services"]
        self.model, self.tmp = model, tmp
        self.ports: dict[tuple[str, int], int] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def port(self, service: str, container_port: int) -> int:
        return self.ports.setdefault((service, container_port), free_port())

    def localize(self, value: str, service: str) -> str:
        """Rewrite one argument or environment value of `service` for this host."""
        def addr(m: re.Match) -> str:
            host, port = m.group(1), int(m.group(2))
            owner = host if host in self.spec else service  # tcp://server:5500 belongs to `server`
            return f"tcp://127.0.0.1:{self.port(owner, port)}"

        value = re.sub(r"tcp://([\w.{}-]+):(\d+)", addr, value)  # {ip}: the prefill's own address
        value = re.sub(r"http://127\.0\.0\.1:(\d+)",
                       lambda m: f"http://127.0.0.1:{self.port(service, int(m.group(1)))}", value)
        return value.replace("/app/models/pdserve-tiny", self.model)

    def argv(self, service: str) -> list[str]:
        words = shlex.split(self.spec[service]["command"])
        assert words[0] == "pdserve"
        out = [sys.executable, "-m", "server.cli"]
        it = iter(words[1:])
        for w in it:
            out.append(w)
            if w == "--host":
                next(it)
                out.append("127.0.0.1")
            elif w == "--port":
                out.append(str(self.port(service, int(next(it)))))
            else:
                out[-1] = self.localize(w, service)
        return out

    def env(self, service: str) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.spec[service]["environment"].items():
            value = self.localize(str(value), service)
            if key == "PDSERVE_HEALTH_PORT":
                value = str(self.port(service, int(value)))
            env[key] = value
        env["PDSERVE_LOG_LEVEL"] = "WARNING"  # keep the test log readable; not a behaviour setting
        return env

    def healthcheck(self, service: str) -> bool:
        cmd = self.spec[service]["healthcheck"]["test"][1:]
        assert cmd[0] == "python"
        argv = [sys.executable, *[self.localize(c, service) for c in cmd[1:]]]
        return subprocess.run(argv, capture_output=True, timeout=15).returncode == 0

    def start(self) -> None:
        for service in ("server", "prefill", "decode"):  # the depends_on order
            self.procs[service] = start_tied(self.argv(service), env=self.env(service), cwd=REPO,
                                             start_new_session=True, stdout=subprocess.DEVNULL)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            proc.wait(timeout=10)


def test_compose_services_run_as_local_processes(checkpoints, tmp_path):
    """Exactly the compose commands and environment, run here; a completion goes through them."""
    stack = LocalCompose(str(checkpoints["qwen3"]), tmp_path)
    stack.start()
    try:
        def all_healthy() -> bool:
            for service, proc in stack.procs.items():
                assert proc.poll() is None, f"{service} exited with {proc.returncode}"
            return all(stack.healthcheck(s) for s in ("prefill", "decode", "server"))

        wait_until(all_healthy, 90, "every compose service's healthcheck to pass", interval=0.5)
        url = f"http://127.0.0.1:{stack.port('server', 8000)}"
        body = {"model": "pdserve-tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["token_ids"]) == 8
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert re.search(r'pdserve:instance_ready\{instance="prefill-[^"]+",role="prefill"\} 1\.0', metrics)
        assert re.search(r'pdserve:instance_ready\{instance="decode-[^"]+",role="decode"\} 1\.0', metrics)
    finally:
        stack.stop()
    assert all(p.poll() is not None for p in stack.procs.values())


# -- Kubernetes ---------------------------------------------------------------------------------

def k8s_docs() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_manifests_parse_and_cli_accepts_their_commands(monkeypatch):
    from server.cli import build_parser

    docs = k8s_docs()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name in ("pdserve-server", "pdserve-prefill", "pdserve-decode"):
        assert ("Deployment", name) in kinds
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    # The ConfigMap's values become flag defaults: they must convert to the flags' types.
    for key, value in config["data"].items():
        monkeypatch.setenv(key, value)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    roles = set()
    for dep in deployments:
        pod = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        for c in pod["spec"]["containers"]:
            argv = [*c.get("command", []), *c.get("args", [])]
            assert argv[0] == "pdserve", f"{dep['metadata']['name']}: not a pdserve command"
            args = build_parser().parse_args(argv[1:])
            roles.add(args.command)
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                target = c[probe]["httpGet"]["port"]
                assert target in ports, f"{probe} on an undeclared port {target}"
            if args.command in ENGINE_ROLES:
                assert args.health_port == ports["health"]
                assert c["readinessProbe"]["httpGet"]["path"] == "/health"
                assert c["livenessProbe"]["httpGet"]["path"] == "/health"
                assert args.server_addr.startswith("tcp://pdserve-server-engines:")
    assert roles == {"server", "prefill", "decode"}
    # Every Service selects pods that some Deployment creates.
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in deployments]
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pod_labels), svc["metadata"]["name"]


# -- engine /health -----------------------------------------------------------------------------

class FakeEngine:
    def __init__(self) -> None:
        from engine.loop_watch import LoopWatch

        self.watch = LoopWatch()
        self.stopping = False


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_engine_health_endpoint_follows_the_loop():
    from engine.health import HealthServer

    health = HealthServer(0, host="127.0.0.1", max_stall_s=0.5, role="decode", name="d0").start()
    url = f"http://127.0.0.1:{health.port}/health"
    try:
        assert _get(url) == (503, {"status": "starting", "role": "decode", "name": "d0"})
        engine = FakeEngine()
        health.attach(engine)
        assert _get(url)[1]["status"] == "starting"  # loaded, but the loop has not turned yet
        engine.watch.tick()
        code, body = _get(url)
        assert code == 200 and body["status"] == "ok"
        engine.watch.begin()
        engine.watch.busy_since -= 30.0  # a step running for 30 s with no history yet: work, not a fault
        engine.watch.last_tick -= 30.0
        code, body = _get(url)
        assert code == 200 and body["status"] == "busy" and body["step_running_s"] >= 30, body
        engine.watch.recent.extend([(0.01, 1)] * 16)  # ...but 3000x its recent steps: stalled, still alive
        code, body = _get(url)
        assert code == 200 and body["status"] == "stalled", body
        engine.watch.end(ran_model=False)  # between steps, and no tick for 30 s: the loop is stuck
        code, body = _get(url)
        assert code == 503 and body["status"] == "stuck", body
        engine.watch.tick()
        engine.stopping = True
        assert _get(url)[0] == 503
        assert _get(f"http://127.0.0.1:{health.port}/nope")[0] == 404
    finally:
        health.stop()
