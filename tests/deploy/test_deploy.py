"""Deployment artifacts checked against the real daemon and the Kubernetes schemas.

- Every manifest (deploy/k8s/*.yaml) and every document the Helm chart renders is validated
  offline against the Kubernetes OpenAPI schemas bundled by kubernetes-validate, strictly
  (unknown fields are errors), for each version in K8S_VERSIONS. The ServiceMonitor (a
  Prometheus Operator CRD, not in those schemas) is checked against a schema of the fields
  used here.
- The chart is rendered by tests/deploy/helm_render.py (a documented subset of Helm's
  template language; Helm itself cannot be installed from this project's registries).
- The config the ConfigMaps, the chart and the image ship is the config proximad starts with
  (only the listen addresses and socket path are moved to free local ones), and the flags the
  DaemonSets, the systemd unit and the Dockerfile pass are flags proximad accepts.
- Every metric name in the Grafana dashboard and in docs/operations.md is one a running
  proximad exports (scraped after real calls), and every label a dashboard query groups by is
  one it exports.
- scripts/container-build.sh (the Dockerfile's recipe) builds and installs into a temporary
  prefix; the installed proximad starts with the installed config and `proximactl health`
  from the prefix reports SERVING.

Environment: PROXIMAD, PROXIMACTL (the binaries; default build/...), PROXIMA_BUILD_DIR (the
build tree container-build.sh reuses; default build/).
"""
import copy
import glob
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import helm_render  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("PROXIMA_BUILD_DIR", os.path.join(ROOT, "build"))
PROXIMAD = os.environ.get("PROXIMAD", os.path.join(BUILD, "daemon", "proximad"))
PROXIMACTL = os.environ.get("PROXIMACTL", os.path.join(BUILD, "tools", "proximactl", "proximactl"))
CHART = os.path.join(ROOT, "helm", "proxima")
K8S_DIR = os.path.join(ROOT, "deploy", "k8s")
# The chart's kubeVersion floor (gRPC probes GA) and a current release.
K8S_VERSIONS = ["1.27.0", "1.33.0"]


# ------------------------------------------------------------------------------------------
# helpers

def k8s_docs():
    docs = []
    for path in sorted(glob.glob(os.path.join(K8S_DIR, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        with open(path) as f:
            docs += [d for d in yaml.safe_load_all(f) if d]
    return docs


def chart_docs(sets=()):
    values = helm_render.load_values(CHART, sets=sets)
    return helm_render.template(CHART, values)


def find(docs, kind):
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, "expected one %s, got %d" % (kind, len(found))
    return found[0]


SERVICE_MONITOR_SCHEMA = {
    # The subset of monitoring.coreos.com/v1 ServiceMonitor these manifests use; unknown
    # fields are errors, as with the Kubernetes schemas.
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "properties": {
                    "matchLabels": {"type": "object",
                                    "additionalProperties": {"type": "string"}}},
                             "additionalProperties": False},
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"matchNames": {
                                          "type": "array", "items": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "required": ["port"],
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": {"type": "string",
                                     "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$"},
                    }}},
            },
        },
    },
}


PROMETHEUS_RULE_SCHEMA = {
    # The subset of monitoring.coreos.com/v1 PrometheusRule the chart uses; unknown fields are
    # errors. The expressions themselves are checked by test_alert_rules_parse_and_use_...
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["groups"], "additionalProperties": False,
            "properties": {"groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "rules": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "required": ["alert", "expr", "labels", "annotations"],
                        "additionalProperties": False,
                        "properties": {
                            "alert": {"type": "string", "pattern": "^[A-Z][A-Za-z]+$"},
                            "expr": {"type": "string"},
                            "for": {"type": "string", "pattern": r"^[0-9]+[smh]$"},
                            "labels": {"type": "object", "required": ["severity"],
                                       "properties": {"severity": {
                                           "enum": ["critical", "warning", "info"]}}},
                            "annotations": {"type": "object",
                                            "required": ["summary", "description"],
                                            "additionalProperties": {"type": "string"}},
                        }}},
                }}}},
        },
    },
}


def validate(doc):
    if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):
        import jsonschema
        jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA if doc["kind"] == "ServiceMonitor"
                            else PROMETHEUS_RULE_SCHEMA)
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail("%s/%s invalid for Kubernetes %s at %s: %s" % (
                doc["kind"], doc["metadata"]["name"], version,
                "/".join(str(p) for p in e.path), e.message))


def port_of(hostport):
    return int(hostport.rsplit(":", 1)[1])


class Daemon:
    """A real proximad on free local ports, started from a config file."""

    def __init__(self, tmp, config_path, proximad=PROXIMAD, extra_args=()):
        self.tmp = tmp
        self.socket = os.path.join(tmp, "proximad.sock")
        port_file = os.path.join(tmp, "ports.json")
        # Only where it listens changes, so that tests do not collide with each other or with
        # a proximad on this machine; every other key comes from the file under test.
        args = [proximad, "--config=" + config_path, "--port_file=" + port_file,
                "--set=server.listen=127.0.0.1:0", "--set=server.metrics_listen=127.0.0.1:0",
                "--set=server.unix_socket=" + self.socket, *extra_args]
        self.log = open(os.path.join(tmp, "proximad.log"), "w+")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                self.log.seek(0)
                self.stop()
                pytest.fail("proximad did not start: %s" % self.log.read())
            time.sleep(0.05)
        with open(port_file) as f:
            ports = json.load(f)
        self.tcp_port, self.metrics_port = ports["tcp_port"], ports["metrics_port"]

    def ctl(self, *args, proximactl=PROXIMACTL, target=None):
        target = target or "unix:" + self.socket
        return subprocess.run([proximactl, *args, "--target=" + target, "--timeout=5"],
                              capture_output=True, text=True, timeout=60)

    def metrics_text(self):
        url = "http://127.0.0.1:%d/metrics" % self.metrics_port
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


@pytest.fixture
def binaries():
    for b in (PROXIMAD, PROXIMACTL):
        if not os.access(b, os.X_OK):
            pytest.fail("%s is not built (set PROXIMAD / PROXIMACTL or build the targets)" % b)


def check_config_accepted(config_text, tmp_path, args=None):
    path = tmp_path / "proxima.yaml"
    path.write_text(config_text)
    args = args or ["--config=" + str(path)]
    r = subprocess.run([PROXIMAD, *args, "--check_config"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, "proximad rejected %s: %s" % (args, r.stderr)
    return path


# ------------------------------------------------------------------------------------------
# manifests and chart against the Kubernetes schemas

def test_k8s_manifests_are_valid():
    docs = k8s_docs()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "ConfigMap", "DaemonSet", "Service",
                            "PodDisruptionBudget", "ServiceMonitor"])
    for d in docs:
        validate(d)
    with open(os.path.join(K8S_DIR, "kustomization.yaml")) as f:
        listed = yaml.safe_load(f)["resources"]
    on_disk = {os.path.basename(p) for p in glob.glob(os.path.join(K8S_DIR, "*.yaml"))}
    assert set(listed) == on_disk - {"kustomization.yaml"}


def test_chart_renders_valid_manifests():
    docs, notes = chart_docs()
    assert sorted(d["kind"] for d in docs) == sorted(
        ["ConfigMap", "DaemonSet", "Service", "PodDisruptionBudget", "ServiceMonitor",
         "PrometheusRule"])
    for d in docs:
        validate(d)
    assert "unix:/run/proxima/proximad.sock" in notes
    assert "vLLM" in notes and "SGLang" in notes
    # Optional parts switch off, and values reach the manifests.
    docs, _ = chart_docs(sets=["serviceMonitor.enabled=false", "podDisruptionBudget.enabled=false",
                               "prometheusRule.enabled=false",
                               "config.tiers.host.capacity_bytes=32GiB",
                               "resources.limits.memory=34Gi", "image.tag=1.2.3"])
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "DaemonSet", "Service"]
    for d in docs:
        validate(d)
    cfg = yaml.safe_load(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    assert cfg["tiers"]["host"]["capacity_bytes"] == "32GiB"
    container = find(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].endswith(":1.2.3")


def test_chart_renders_only_the_features_asked_for():
    docs, _ = chart_docs()
    rendered = find(docs, "ConfigMap")["data"]["proxima.yaml"]
    for word in ("tls", "token", "discovery", "gpu"):
        assert word not in rendered.lower()
    # The GPU tier is proximad's config, verbatim.
    docs, _ = chart_docs(sets=["config.tiers.gpu.capacity_bytes_per_device=8GiB"])
    cfg = yaml.safe_load(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    assert cfg["tiers"]["gpu"]["capacity_bytes_per_device"] == "8GiB"


def test_chart_wires_the_ucx_data_plane():
    docs, _ = chart_docs()
    cfg = yaml.safe_load(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    assert cfg["ucx"] == {"enabled": True, "max_sessions": 1024}
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["hostIPC"] is False
    docs, _ = chart_docs(sets=["hostIPC=true", "config.ucx.enabled=false"])
    assert find(docs, "DaemonSet")["spec"]["template"]["spec"]["hostIPC"] is True
    cfg = yaml.safe_load(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    assert cfg["ucx"]["enabled"] is False


def test_chart_wires_cluster_mode(binaries, tmp_path):
    sets = ["cluster.enabled=true", "cluster.peerTokenSecret=proxima-peer"]
    docs, _ = chart_docs(sets=sets)
    for d in docs:
        validate(d)
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    args = container["args"]
    assert "--set=cluster.advertise=$(POD_IP):50051" in args
    service = find(docs, "Service")
    assert service["spec"]["clusterIP"] == "None"
    dns = "%s.%s.svc.cluster.local" % (service["metadata"]["name"],
                                       service["metadata"]["namespace"])
    assert "--set=cluster.dns_name=" + dns in args
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["peer-token"]["secret"]["secretName"] == "proxima-peer"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["peer-token"]["mountPath"] == "/etc/proxima-peer"
    # proximad accepts the rendered config with the rendered arguments, as the kubelet would
    # run them (POD_IP expanded, the Secret's file in place).
    token = tmp_path / "token"
    token.write_text("peer-token-for-the-chart-test-0123456789\n")
    token.chmod(0o600)
    config = tmp_path / "proxima.yaml"
    config.write_text(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    run_args = [a.replace("$(POD_IP)", "127.0.0.1")
                 .replace("/etc/proxima-peer/token", str(token))
                 .replace("/etc/proxima/proxima.yaml", str(config)) for a in args]
    check_config_accepted(config.read_text(), tmp_path, args=run_args)
    assert not any("cluster.tls" in a for a in args)  # plaintext peers without TLS
    # Without a peer-token Secret, the chart refuses to render.
    with pytest.raises(helm_render.RenderError, match="peerTokenSecret"):
        chart_docs(sets=["cluster.enabled=true"])
    # Together with TLS (mTLS here): the peers talk TLS and check the Service's name, which the
    # Secret's certificate carries (pod IPs are not in it); proximad accepts the result.
    tls = sets + ["tls.secretName=proxima-tls",
                  "config.server.tls={cert_file: /etc/proxima-tls/tls.crt, "
                  "key_file: /etc/proxima-tls/tls.key, client_ca_file: /etc/proxima-tls/ca.crt}"]
    docs, _ = chart_docs(sets=tls)
    for d in docs:
        validate(d)
    args = find(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    service = find(docs, "Service")
    assert "--set=cluster.tls.server_name=%s.%s.svc" % (
        service["metadata"]["name"], service["metadata"]["namespace"]) in args
    config.write_text(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    run_args = [a.replace("$(POD_IP)", "127.0.0.1")
                 .replace("/etc/proxima-peer/token", str(token))
                 .replace("/etc/proxima/proxima.yaml", str(config)) for a in args]
    check_config_accepted(config.read_text(), tmp_path, args=run_args)
    docs, _ = chart_docs(sets=tls + ["cluster.tlsServerName=peers.example.com"])
    args = find(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--set=cluster.tls.server_name=peers.example.com" in args
    # Off by default: no cluster arguments, no peer-token volume.
    pod = find(chart_docs()[0], "DaemonSet")["spec"]["template"]["spec"]
    assert not any("cluster" in a for a in pod["containers"][0]["args"])
    assert "peer-token" not in {v["name"] for v in pod["volumes"]}


def test_chart_wires_the_snapshot(binaries, tmp_path):
    docs, _ = chart_docs(sets=["snapshot.enabled=true"])
    for d in docs:
        validate(d)
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert "--set=tiers.host.snapshot_file=/var/lib/proxima/snapshot" in args
    assert "--set=tiers.host.snapshot_seconds=10" in args
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["snapshot-dir"]["hostPath"] == {"path": "/var/lib/proxima",
                                                  "type": "DirectoryOrCreate"}
    init = pod["initContainers"][0]
    for c in (container, init):
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["snapshot-dir"]["mountPath"] == "/var/lib/proxima"
        assert not mounts["snapshot-dir"].get("readOnly", False)
    assert "chown 10001:10001 /run/proxima /var/lib/proxima" in init["command"][-1]
    assert "chmod 0700 /var/lib/proxima" in init["command"][-1]
    # preStop + drain + the snapshot's write fit in the termination grace period.
    cfg = yaml.safe_load(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    pre = container["lifecycle"]["preStop"]["exec"]["command"][-1]
    pre_s = int(re.fullmatch(r"sleep (\d+)", pre).group(1))
    assert pre_s + cfg["server"]["shutdown_grace_seconds"] + 10 < \
        pod["terminationGracePeriodSeconds"]
    # proximad accepts the rendered config with the rendered arguments (the directory here).
    config = tmp_path / "proxima.yaml"
    config.write_text(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    run_args = [a.replace("/var/lib/proxima", str(tmp_path))
                 .replace("/etc/proxima/proxima.yaml", str(config)) for a in args]
    check_config_accepted(config.read_text(), tmp_path, args=run_args)
    # Never with cluster mode (a restarted node would bring back blocks deleted meanwhile).
    with pytest.raises(helm_render.RenderError, match="snapshot.enabled and cluster.enabled"):
        chart_docs(sets=["snapshot.enabled=true", "cluster.enabled=true",
                         "cluster.peerTokenSecret=proxima-peer"])
    # Off by default: no snapshot arguments, no volume, the socket directory alone.
    pod = find(chart_docs()[0], "DaemonSet")["spec"]["template"]["spec"]
    assert not any("snapshot" in a for a in pod["containers"][0]["args"])
    assert "snapshot-dir" not in {v["name"] for v in pod["volumes"]}
    assert "/var/lib/proxima" not in pod["initContainers"][0]["command"][-1]


def test_chart_mounts_tls_and_token_secrets(binaries, tmp_path):
    sets = ["tls.secretName=proxima-tls", "tokens.secretName=proxima-tokens",
            "config.server.tls={cert_file: /etc/proxima-tls/tls.crt, "
            "key_file: /etc/proxima-tls/tls.key, client_ca_file: /etc/proxima-tls/ca.crt}",
            "config.namespaces=[{name: default, tokens: [{name: worker, "
            "file: /etc/proxima-tokens/default-worker}, {name: dashboard, "
            "file: /etc/proxima-tokens/default-ro, access: read_only}]}]"]
    docs, _ = chart_docs(sets=sets)
    for d in docs:
        validate(d)
    pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "proxima-tls"
    assert volumes["tokens"]["secret"]["secretName"] == "proxima-tokens"
    assert pod["securityContext"]["fsGroup"] == 10001
    container = pod["containers"][0]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["tls"]["mountPath"] == "/etc/proxima-tls" and mounts["tls"]["readOnly"]
    assert mounts["tokens"]["mountPath"] == "/etc/proxima-tokens"
    # The kubelet's gRPC probe cannot speak TLS: the probes ask over the Unix socket.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["/usr/local/bin/proximactl", "health"]
        assert "--target=unix:/run/proxima/proximad.sock" in command
    # proximad accepts the rendered config (file contents are checked at start, not here).
    check_config_accepted(find(docs, "ConfigMap")["data"]["proxima.yaml"], tmp_path)
    # Without the secrets nothing is mounted and the gRPC probes stay.
    pod = find(chart_docs()[0], "DaemonSet")["spec"]["template"]["spec"]
    assert not {"tls", "tokens"} & {v["name"] for v in pod["volumes"]}
    assert "grpc" in pod["containers"][0]["readinessProbe"]


def test_chart_renders_the_compression_policy():
    # Compression is real now: the chart's default namespace carries a policy proximad accepts
    # (the config itself is checked against the real proximad by the tests above).
    docs, _ = chart_docs()
    cfg = yaml.safe_load(find(docs, "ConfigMap")["data"]["proxima.yaml"])
    policy = cfg["namespaces"][0]["compression"]
    assert policy["enabled"] is True
    assert policy["levels"] == ["int8", "layers[0:2]=int8,default=int4,sink=int8"]


def test_renderer_rejects_what_it_does_not_support(tmp_path):
    # The renderer must fail loudly rather than render something Helm would not.
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("name: t\nversion: 0.0.1\n")
    (tmp_path / "values.yaml").write_text("a: {b: 1}\n")
    for body, err in [("{{ range .Values.a }}x{{ end }}", "range"),
                      ("{{ .Values.a.missing }}", "names no value"),
                      ("{{ .Values.a }}", "toYaml"),
                      ("{{ lower .Values.a.b }}", "lower")]:
        (tmp_path / "templates" / "x.yaml").write_text(body)
        with pytest.raises(helm_render.RenderError, match=err):
            helm_render.template(str(tmp_path), helm_render.load_values(str(tmp_path)))
    (tmp_path / "templates" / "x.yaml").write_text(
        'k: {{ .Values.a.b | quote }}\n{{- if .Values.a.c }}\nno\n{{- else }}\nv: ok\n{{- end }}\n')
    docs, _ = helm_render.template(str(tmp_path), helm_render.load_values(str(tmp_path)))
    assert docs == [{"k": "1", "v": "ok"}]


def test_ports_probes_and_grace_agree_with_config():
    for docs in (k8s_docs(), chart_docs()[0]):
        cfg = yaml.safe_load(find(docs, "ConfigMap")["data"]["proxima.yaml"])
        pod = find(docs, "DaemonSet")["spec"]["template"]["spec"]
        c = [c for c in pod["containers"] if c["name"] == "proximad"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == port_of(cfg["server"]["listen"])
        assert ports["metrics"] == port_of(cfg["server"]["metrics_listen"])
        assert cfg["server"]["listen"].startswith("0.0.0.0:")  # probes come from the kubelet
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == ports["grpc"]
        assert c["readinessProbe"]["grpc"]["service"] == "proxima.v1.KVTier"
        # Health turns NOT_SERVING for every service at the drain: liveness must outlast it.
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > \
            cfg["server"]["shutdown_grace_seconds"]
        # The socket directory is the hostPath shared with workers.
        sock_dir = os.path.dirname(cfg["server"]["unix_socket"])
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert mounts["socket-dir"] == sock_dir
        assert vols["socket-dir"]["hostPath"]["path"] == sock_dir
        assert mounts["config"] == "/etc/proxima"
        # preStop + drain + the cluster's hand-off must fit in the termination grace period.
        pre = c["lifecycle"]["preStop"]["exec"]["command"][-1]
        pre_s = int(re.fullmatch(r"sleep (\d+)", pre).group(1))
        handoff = str(cfg.get("cluster", {}).get("spill", {}).get("handoff", "10s"))
        handoff_s = float(re.fullmatch(r"([0-9.]+)s?", handoff).group(1))
        assert pre_s + cfg["server"]["shutdown_grace_seconds"] + handoff_s < \
            pod["terminationGracePeriodSeconds"]
        # Memory limit above the host tier's capacity.
        limit = c["resources"]["limits"]["memory"]
        assert limit.endswith("Gi") and cfg["tiers"]["host"]["capacity_bytes"].endswith("GiB")
        assert int(limit[:-2]) > int(cfg["tiers"]["host"]["capacity_bytes"][:-3])
        svc = find(docs, "Service")
        assert svc["spec"]["clusterIP"] == "None"
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
        sm = find(docs, "ServiceMonitor")
        assert sm["spec"]["endpoints"][0]["port"] in ports
        sel = find(docs, "DaemonSet")["spec"]["selector"]["matchLabels"]
        for selector in (svc["spec"]["selector"], sm["spec"]["selector"]["matchLabels"],
                         find(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]):
            assert selector == sel


# ------------------------------------------------------------------------------------------
# the daemon accepts what the manifests pass

def test_configs_are_one_and_accepted(binaries, tmp_path):
    with open(os.path.join(ROOT, "deploy", "config", "proxima.yaml")) as f:
        shipped = f.read()
    k8s_cfg = find(k8s_docs(), "ConfigMap")["data"]["proxima.yaml"]
    assert k8s_cfg == shipped, "deploy/k8s/configmap.yaml and deploy/config/proxima.yaml differ"
    chart_cfg = find(chart_docs()[0], "ConfigMap")["data"]["proxima.yaml"]
    assert yaml.safe_load(chart_cfg) == yaml.safe_load(shipped)
    for text in (shipped, chart_cfg):
        check_config_accepted(text, tmp_path)
    # And an unknown key is refused, so the acceptance above means something.
    bad = tmp_path / "bad.yaml"
    bad.write_text(chart_cfg + "compression:\n  enabled: true\n")
    r = subprocess.run([PROXIMAD, "--config=" + str(bad), "--check_config"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "compression" in r.stderr


def container_argv(docs):
    c = find(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    return c["command"] + c["args"]


def test_manifest_flags_are_accepted(binaries, tmp_path):
    with open(os.path.join(ROOT, "deploy", "config", "proxima.yaml")) as f:
        cfg = check_config_accepted(f.read(), tmp_path)
    argvs = [container_argv(k8s_docs()), container_argv(chart_docs()[0])]
    with open(os.path.join(ROOT, "deploy", "systemd", "proximad.service")) as f:
        for line in f:
            if line.startswith(("ExecStart=", "ExecStartPre=", "ExecReload=")):
                argv = shlex.split(line.split("=", 1)[1])
                if argv[0] != "/bin/kill":  # ExecReload's SIGHUP
                    argvs.append(argv)
    with open(os.path.join(ROOT, "deploy", "Dockerfile")) as f:
        dockerfile = f.read()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    argvs.append(entry + cmd)
    assert len(argvs) == 6
    for argv in argvs:
        assert argv[0] == "/usr/local/bin/proximad", argv
        args = [a.replace("/etc/proxima/proxima.yaml", str(cfg)) for a in argv[1:]]
        args = [a for a in args if a != "--check_config"]
        r = subprocess.run([PROXIMAD, *args, "--check_config"], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, "proximad rejected %s: %s" % (argv, r.stderr)


def test_rendered_config_serves_and_drains(binaries, tmp_path):
    chart_cfg = find(chart_docs()[0], "ConfigMap")["data"]["proxima.yaml"]
    path = tmp_path / "proxima.yaml"
    path.write_text(chart_cfg)
    d = Daemon(str(tmp_path), str(path))
    try:
        # What the probes ask: the gRPC health service over TCP, for both service names.
        tcp = "127.0.0.1:%d" % d.tcp_port
        for service in ("proxima.v1.KVTier", ""):
            r = d.ctl("health", "--service=" + service, target=tcp)
            assert r.returncode == 0, r.stdout + r.stderr
        # What same-node workers and the image's HEALTHCHECK use: the Unix socket.
        r = d.ctl("health")
        assert r.returncode == 0, r.stdout + r.stderr
        mode = os.stat(d.socket).st_mode & 0o777
        assert mode == int(yaml.safe_load(chart_cfg)["server"]["unix_socket_mode"], 8)
    finally:
        rc = d.stop()
    assert rc == 0, "proximad did not drain and exit 0 on SIGTERM"


# ------------------------------------------------------------------------------------------
# metric names

def scrape_names(text):
    names, labels = set(), {"instance", "job", "le"}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            names.add(m.group(1))
            if m.group(2) == "histogram":
                names |= {m.group(1) + s for s in ("_bucket", "_sum", "_count")}
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s", line)
        if m:
            names.add(m.group(1))
            labels |= set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
    return names, labels


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    for b in (PROXIMAD, PROXIMACTL):
        if not os.access(b, os.X_OK):
            pytest.fail("%s is not built" % b)
    tmp = str(tmp_path_factory.mktemp("metrics"))
    path = os.path.join(tmp, "proxima.yaml")
    with open(os.path.join(ROOT, "deploy", "config", "proxima.yaml")) as f, open(path, "w") as o:
        o.write(f.read())
    # With a snapshot file, so that the series of the snapshot's load exist.
    d = Daemon(tmp, path, extra_args=(
        "--set=tiers.host.snapshot_file=%s" % os.path.join(tmp, "snapshot"),))
    try:
        # Real calls, so that per-call series (requests by code, latency) exist.
        for args in (["put", "--count=4"], ["get", "--count=4"], ["lookup", "--count=8"],
                     ["get", "--first=100", "--count=1"]):
            d.ctl(*args)
        text = d.metrics_text()
    finally:
        d.stop()
    # The cluster's series exist only with the cluster on: the same config as a one-node
    # cluster whose only peer never answers (no other daemon is needed to register them).
    token = os.path.join(tmp, "peer.token")
    with open(token, "w") as f:
        f.write("deploy-test-peer-token-0123456789abcdef\n")
    os.chmod(token, 0o600)
    ctmp = str(tmp_path_factory.mktemp("metrics-cluster"))
    # It also caps its namespace (namespaces[].max_bytes), whose series exist only with a limit.
    c = Daemon(ctmp, path, extra_args=(
        "--set=cluster.enabled=true", "--set=cluster.advertise=127.0.0.1:9",
        "--set=cluster.peers=[127.0.0.1:9]", "--set=cluster.peer_token={file: %s}" % token,
        "--set=namespaces=[{name: default, max_bytes: 64MiB}]"))
    try:
        text += c.metrics_text()
    finally:
        c.stop()
    names, labels = scrape_names(text)
    return names, labels, text


def dashboard_exprs():
    with open(os.path.join(ROOT, "deploy", "grafana", "proxima-dashboard.json")) as f:
        dash = json.load(f)
    exprs = []
    for p in dash["panels"]:
        exprs += [t["expr"] for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if isinstance(v.get("query"), dict):
            exprs.append(v["query"]["query"])
    return exprs


def test_dashboard_uses_only_exported_metrics(exported):
    names, labels, _ = exported
    exprs = dashboard_exprs()
    assert len(exprs) >= 12
    used = set()
    for e in exprs:
        used |= set(re.findall(r"\b(?:proxima|process)_[a-z0-9_]+", e))
        for group in re.findall(r"\bby \(([^)]*)\)", e):
            for label in (x.strip() for x in group.split(",")):
                assert label in labels, "dashboard groups by %r, which no series has" % label
        for label in re.findall(r"\{([a-z_]+)=~", e) + re.findall(r", ([a-z_]+)=~", e):
            assert label in labels, label
    missing = sorted(used - names)
    assert not missing, "dashboard uses metrics proximad does not export: %s" % missing
    # The dashboard covers the metrics an operator needs first.
    for needed in ("proxima_tier_used_bytes", "proxima_get_hits_total",
                   "proxima_transfer_bytes_total", "proxima_request_duration_seconds_bucket"):
        assert needed in used


def test_alert_rules_parse_and_use_exported_metrics(exported):
    import promql_parser
    names, labels, text = exported
    docs, _ = chart_docs(sets=["prometheusRule.labels={release: kube-prometheus}"])
    rule = find(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    service = find(docs, "Service")["metadata"]["name"]
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(rules) >= 6
    used = set()
    for r in rules:
        try:
            promql_parser.parse(r["expr"])
        except ValueError as e:
            pytest.fail("alert %s: expr %r is not PromQL: %s" % (r["alert"], r["expr"], e))
        used |= set(re.findall(r"\b(?:proxima|process)_[a-z0-9_]+", r["expr"]))
        for group in re.findall(r"\bby \(([^)]*)\)", r["expr"]):
            for label in (x.strip() for x in group.split(",")):
                assert label in labels, "alert %s groups by %r, which no series has" % (
                    r["alert"], label)
        for label in re.findall(r"[{,]([a-z_]+)=~", r["expr"]):
            assert label in labels, (r["alert"], label)
    missing = sorted(used - names)
    assert not missing, "alerts use metrics proximad does not export: %s" % missing
    # The daemon-down alert watches the job the ServiceMonitor makes (the Service's name).
    down = next(r for r in rules if r["alert"] == "ProximaDaemonDown")
    assert down["expr"] == 'up{job="%s"} == 0' % service
    # The label values the alerts match are values proximad exports: snapshot states by name,
    # status codes by name (as "OK" is), not by number.
    for value in ("partial", "failed"):
        assert 'proxima_snapshot_load_state{state="%s"}' % value in text
    assert re.search(r'proxima_requests_total\{[^}]*code="OK"', text)


def test_docs_use_only_exported_metrics(exported):
    names, _, _ = exported
    for doc in ("docs/operations.md", "README.md", "helm/proxima/templates/NOTES.txt"):
        with open(os.path.join(ROOT, doc)) as f:
            used = set(re.findall(r"\b(?:proxima|process)_[a-z0-9_]+", f.read()))
        missing = sorted(u for u in used - names)
        assert not missing, "%s names metrics proximad does not export: %s" % (doc, missing)


# ------------------------------------------------------------------------------------------
# the image recipe

def test_container_build_script_installs_a_working_daemon(binaries, tmp_path):
    prefix = tmp_path / "prefix"
    # Reuses the configured build tree: the build step is then an up-to-date check (seconds),
    # the install and the config check run for real.
    r = subprocess.run([os.path.join(ROOT, "scripts", "container-build.sh"), "build", BUILD,
                        str(prefix)], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    for f in ("bin/proximad", "bin/proximactl", "etc/proxima/proxima.yaml"):
        assert (prefix / f).exists(), f
    r = subprocess.run([os.path.join(ROOT, "scripts", "container-build.sh"), "runtime-packages",
                        str(prefix)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    packages = r.stdout.split()
    assert any(p.startswith("libgrpc++") for p in packages), packages
    assert any(p.startswith("libyaml-cpp") for p in packages), packages
    assert not any(p.endswith("-dev") for p in packages), packages

    d = Daemon(str(tmp_path), str(prefix / "etc/proxima/proxima.yaml"),
               proximad=str(prefix / "bin/proximad"))
    try:
        r = d.ctl("health", proximactl=str(prefix / "bin/proximactl"))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        assert d.stop() == 0


def test_dockerfile_follows_the_script():
    with open(os.path.join(ROOT, "deploy", "Dockerfile")) as f:
        text = f.read()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(froms) == 2
    for image in froms:
        name, _, tag = image.partition(":")
        assert name == "nvidia/cuda" and re.match(r"\d+\.\d+\.\d+-", tag), image
    with open(os.path.join(ROOT, "scripts", "container-build.sh")) as f:
        script = f.read()
    subs = re.findall(r"^(?:RUN| &&)[^\n]*?container-build\.sh ([a-z-]+)", text, re.M)
    assert sorted(subs) == ["build", "deps", "runtime-packages"], subs
    for sub in subs:
        assert re.search(r"^\s+%s\)" % re.escape(sub), script, re.M), sub
    assert re.search(r"^USER 10001", text, re.M)
    hc = re.search(r'^HEALTHCHECK .*\n\s+CMD (\[.*\])', text, re.M)
    argv = json.loads(hc.group(1))
    assert argv[:2] == ["/usr/local/bin/proximactl", "health"]
    with open(os.path.join(ROOT, "deploy", "config", "proxima.yaml")) as f:
        sock = yaml.safe_load(f)["server"]["unix_socket"]
    assert "--target=unix:" + sock in argv
