"""packaging/kubernetes/: the manifests validate against Kubernetes' own schemas (strict: an
unknown field is an error), agree with each other and with the node installer, and the node
labeller speaks the API server's language (against a local fake server)."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from torpor import config

kv = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "packaging" / "kubernetes"
# the oldest Kubernetes whose kubelet checkpoint API is on by default (beta), and the newest
VERSIONS = ("1.30.0", kv.latest_version())


def documents() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[f"{doc['kind']}/{doc['metadata']['name'] if 'metadata' in doc else path.name}"] = doc
    return docs


def one(kind: str) -> dict:
    found = [d for d in documents().values() if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def script_default(name: str, var: str) -> str:
    m = re.search(rf'^{var}="\$\{{{var}:?-([^}}]*)\}}"', (K8S / name).read_text(), re.M)
    assert m, f"{name} sets no default for {var}"
    return m.group(1)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version: str) -> None:
    docs = {k: d for k, d in documents().items() if d["kind"] != "Kustomization"}
    assert {d["kind"] for d in docs.values()} >= {
        "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap",
        "DaemonSet", "RuntimeClass"}
    for name, doc in docs.items():
        kv.validate(doc, version, strict=True)
        # the check can fail: the same document with a misspelt field is refused
        bad = json.loads(json.dumps(doc))
        bad["metadata"]["lables"] = {}
        with pytest.raises(kv.ValidationError):
            kv.validate(bad, version, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kust = one("Kustomization")
    listed = set(kust["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_runtime_class_handler_label_and_daemonset_agree_with_the_installer() -> None:
    rc, ds = one("RuntimeClass"), one("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    init = spec["initContainers"][0]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert rc["handler"] == env["HANDLER"] == script_default("node-install.sh", "HANDLER")
    # pods of the class land only where node-run.sh put the label label-node.py writes
    labeller = (K8S / "label-node.py").read_text()
    (key, value), = rc["scheduling"]["nodeSelector"].items()
    assert f'LABEL = "{key}"' in labeller and value == "ready" and '"ready"' in labeller
    # what the init container writes through HOST_ROOT is mounted from the node
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    node_dir = env["NODE_DIR"]
    assert env["HOST_ROOT"] + str(Path(node_dir).parent) in mounts
    assert env["HOST_ROOT"] + script_default("node-install.sh", "CONTAINERD_DIR") in mounts
    assert env["HOST_ROOT"] + script_default("node-install.sh", "TORPOR_ETC") in mounts
    config_mount = next(m for m in init["volumeMounts"] if m["name"] == "config")
    assert str(Path(script_default("node-install.sh", "CONFIG")).parent) == config_mount["mountPath"]
    # the main container finds torpord's socket where node-run.sh waits for it
    main = spec["containers"][0]
    socket = script_default("node-run.sh", "SOCKET")
    assert any(socket.startswith(m["mountPath"] + "/") for m in main["volumeMounts"])
    assert {e["name"] for e in main["env"]} >= {"NODE_NAME", "NODE_DIR"}
    assert spec["hostPID"] is True and spec["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]
    # the commands the pod runs are the ones the image installs
    containerfile = (K8S / "Containerfile").read_text()
    for c in (init, main):
        assert Path(c["command"][0]).name in containerfile


def test_the_config_map_is_a_config_torpor_accepts(tmp_path: Path) -> None:
    cm = one("ConfigMap")
    path = tmp_path / "config.toml"
    path.write_text(cm["data"]["config.toml"])
    cfg = config.load(path, env={})
    assert cfg.agent is True and cfg.oci_runtime == "runc"


class FakeApi(http.server.BaseHTTPRequestHandler):
    calls: list[tuple[str, str, dict, str]] = []
    status = 200

    def do_PATCH(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeApi.calls.append((self.path, self.headers["Content-Type"], body,
                              self.headers["Authorization"]))
        self.send_response(FakeApi.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_api(tmp_path: Path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeApi.calls, FakeApi.status = [], 200
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("sekrit\n")
    yield {"TORPOR_K8S_API": f"http://127.0.0.1:{server.server_port}",
           "TORPOR_SA_DIR": str(account), "NODE_NAME": "gpu-node-1", "PATH": "/usr/bin:/bin"}
    server.shutdown()


def label(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(K8S / "label-node.py"), *args], env=env,
                          capture_output=True, text=True, timeout=30)


def test_label_node_sets_and_removes_the_label_with_the_account_token(fake_api) -> None:
    assert label(fake_api, "set").returncode == 0
    assert label(fake_api, "remove").returncode == 0
    (p1, t1, b1, a1), (p2, _, b2, _) = FakeApi.calls
    assert p1 == p2 == "/api/v1/nodes/gpu-node-1"
    assert t1 == "application/merge-patch+json" and a1 == "Bearer sekrit"
    assert b1 == {"metadata": {"labels": {"torpor.dev/runtime": "ready"}}}
    assert b2 == {"metadata": {"labels": {"torpor.dev/runtime": None}}}


def test_label_node_refused_or_misused_says_one_line(fake_api) -> None:
    FakeApi.status = 403
    r = label(fake_api, "set")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "gpu-node-1" in r.stderr
    assert label(fake_api, "bogus").returncode == 2
    r = label({k: v for k, v in fake_api.items() if k != "NODE_NAME"}, "set")
    assert r.returncode == 1 and "NODE_NAME" in r.stderr
