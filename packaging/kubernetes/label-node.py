"""label-node.py set|remove: put torpor.dev/runtime=ready on this pod's node, or take it off.

Runs in the DaemonSet's pod with its service account (rbac.yaml: get and patch nodes); the node
is $NODE_NAME (the downward API). Talks to the API server the way in-cluster clients do:
https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, the account's token and CA from
/var/run/secrets/kubernetes.io/serviceaccount. One JSON merge patch; the standard library only
(the image carries no Kubernetes client). Exit 0 done, 1 the API said no or could not be
reached (one line on stderr).
"""
from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.error
import urllib.request

LABEL = "torpor.dev/runtime"
ACCOUNT = os.environ.get("TORPOR_SA_DIR", "/var/run/secrets/kubernetes.io/serviceaccount")


def api_base() -> str:
    if "TORPOR_K8S_API" in os.environ:          # tests: a local fake API server
        return os.environ["TORPOR_K8S_API"].rstrip("/")
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def patch_label(node: str, value: str | None) -> None:
    body = json.dumps({"metadata": {"labels": {LABEL: value}}}).encode()
    with open(os.path.join(ACCOUNT, "token")) as f:
        token = f.read().strip()
    req = urllib.request.Request(
        f"{api_base()}/api/v1/nodes/{urllib.request.quote(node, safe='')}", data=body,
        method="PATCH", headers={"Content-Type": "application/merge-patch+json",
                                 "Authorization": f"Bearer {token}"})
    ca = os.path.join(ACCOUNT, "ca.crt")
    ctx = ssl.create_default_context(cafile=ca) if os.path.exists(ca) else None
    with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
        resp.read()


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("set", "remove"):
        print("usage: label-node.py set|remove", file=sys.stderr)
        return 2
    node = os.environ.get("NODE_NAME", "")
    if not node:
        print("label-node: NODE_NAME is not set (the downward API gives it)", file=sys.stderr)
        return 1
    try:
        patch_label(node, "ready" if argv[0] == "set" else None)
    except (OSError, KeyError, urllib.error.URLError) as e:
        print(f"label-node: node {node}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
