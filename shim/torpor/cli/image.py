"""torpor image build|push|pull: checkpoints as OCI checkpoint images, moved between nodes
through a container registry (the containers auth files and certs.d apply)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from .. import gpus, placement
from ..errors import NoDriverError, PreflightError, UsageError
from ..flows import policy
from ..placement import parse_device_map
from ..progress import human_bytes
from ..registry import auth, build, transfer
from ..registry.client import Client
from .context import Context, path_arg


def _registry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--authfile", type=path_arg,
                   help="credentials file (default: $REGISTRY_AUTH_FILE, then podman's and "
                        "docker's: containers-auth.json(5))")
    p.add_argument("--cert-dir", type=path_arg,
                   help="CA certificates (*.crt) and client certificate for the registry "
                        "(default /etc/containers/certs.d/HOST:PORT)")
    p.add_argument("--tls-verify", action=argparse.BooleanOptionalAction, default=True,
                   help="verify the registry's TLS certificate (default: yes)")
    p.add_argument("--jobs", type=int, default=transfer.WORKERS, metavar="N",
                   help=f"connections at once (default {transfer.WORKERS})")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("image", help="build, push and pull checkpoint images (OCI)",
                       description=__doc__)
    isub = p.add_subparsers(dest="image_command", metavar="ACTION", required=True)
    b = isub.add_parser("build", help="build the checkpoint image of a checkpoint",
                        description="Build the standard OCI checkpoint image of a checkpoint "
                        "directory (packed into the store or not) or a podman export archive, "
                        "into a new OCI image layout directory. A packed checkpoint's chunks "
                        "go beside it as a chunk artifact.")
    b.add_argument("source", type=path_arg, help="checkpoint directory or archive")
    b.add_argument("-o", "--output", type=path_arg, required=True,
                   help="new or empty directory for the OCI image layout")
    b.add_argument("--name", default="", help="container name the annotations carry")
    b.add_argument("--tag", default="latest", help="the image's tag in the layout")
    b.set_defaults(action=_build)
    u = isub.add_parser("push", help="push a checkpoint image layout to a registry",
                        description="Upload an image layout built by 'torpor image build': only "
                        "the blobs the registry lacks; a push cut off resumes when run again.")
    u.add_argument("layout", type=path_arg, help="OCI image layout directory")
    u.add_argument("reference", help="HOST[:PORT]/REPOSITORY[:TAG]")
    _registry_args(u)
    u.set_defaults(action=_push)
    g = isub.add_parser("pull", help="pull a checkpoint image into a new checkpoint directory",
                        description="Fetch a checkpoint image, every blob verified, into a new "
                        "directory; a packed checkpoint's chunks come from the node's image "
                        "store where it has them. Then: torpor restore -D <its checkpoint>.")
    g.add_argument("reference", help="HOST[:PORT]/REPOSITORY[:TAG][@sha256:DIGEST]")
    g.add_argument("-D", "--directory", type=path_arg, required=True,
                   help="new or empty directory for the image's files (created 0700)")
    g.add_argument("--oci-layout", type=path_arg,
                   help="also keep the image (manifest, config, layer) as an OCI layout here")
    g.add_argument("--device-map", action="append", default=[], metavar="OLD=NEW",
                   help="the GPU map the restore will be given: the pre-flight checks it")
    g.add_argument("--no-preflight", action="store_true",
                   help="pull even if this node's GPUs cannot take the checkpoint (to restore "
                        "it elsewhere)")
    g.add_argument("--archive", type=path_arg,
                   help="also write the verified layer here as a checkpoint archive (for a "
                        "podman image: podman container restore --import ARCHIVE)")
    _registry_args(g)
    g.set_defaults(action=_pull)
    for action in (b, u, g):   # --json after the action too
        action.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                            help="print the result as JSON")


def _client(args: argparse.Namespace) -> Client:
    ref = auth.parse_reference(args.reference)
    return Client(ref, auth.tls_context(ref.host, args.cert_dir, args.tls_verify),
                  auth.credentials(ref, args.authfile))


def _jobs(args: argparse.Namespace) -> int:
    if not 1 <= args.jobs <= 64:
        raise UsageError("--jobs must be 1 to 64")
    return args.jobs


def _preflight(device_map: dict[str, str]) -> Callable[[dict[str, Any]], None]:
    """The restore's GPU pre-flight (placement.plan), run on a pulled manifest before its
    chunks are fetched: a node whose GPUs cannot take the checkpoint says so first (exit 7)."""
    def check(m: dict[str, Any]) -> None:
        if not any(p.get("cuda") for p in m["processes"]):
            if device_map:
                raise UsageError("--device-map given but the checkpoint holds no GPU state")
            return
        try:
            inv = gpus.discover()
        except NoDriverError as e:
            raise PreflightError(f"the checkpoint holds GPU state but {e}",
                                 hint="--no-preflight pulls it anyway") from e
        placement.plan(m, inv, device_map, share="container" not in m)
    return check


def _build(args: argparse.Namespace, ctx: Context) -> None:
    r = build.build(args.source, args.output, args.name, args.tag)
    ctx.emit(dataclasses.asdict(r) | {"layout": str(r.layout)},
             f"built checkpoint image {r.digest} in {r.layout}: layer {human_bytes(r.layer_bytes)}"
             + (f", {r.chunks} chunk(s) of {human_bytes(r.chunk_bytes)} beside it"
                if r.chunks else ""))


def _push(args: argparse.Namespace, ctx: Context) -> None:
    client = _client(args)
    try:
        r = transfer.push(args.layout, client, ctx.cfg.state_dir, ctx.progress.say, _jobs(args))
    finally:
        client.close()
    ctx.emit(dataclasses.asdict(r),
             f"pushed {r.reference} ({r.digest}): {r.uploaded_blobs} of {r.blobs} blob(s) "
             f"uploaded, {r.skipped_blobs} already there"
             + (f", {r.resumed_blobs} resumed" if r.resumed_blobs else "")
             + f"; {human_bytes(r.bytes_sent)} sent of {human_bytes(r.bytes_total)}")


def _pull(args: argparse.Namespace, ctx: Context) -> None:
    client = _client(args)
    try:
        check = None if args.no_preflight else _preflight(parse_device_map(args.device_map))
        r = transfer.pull(client, args.directory, policy.open_store(ctx.cfg), args.oci_layout,
                          args.archive, _jobs(args), check)
    finally:
        client.close()
    ctx.emit(dataclasses.asdict(r),
             f"pulled {r.reference} ({r.digest}) into {r.directory}, every blob verified"
             + (f": {r.chunks} chunk(s), {r.chunks_fetched} fetched, {r.chunks_from_store} "
                "from the image store" if r.chunks else "")
             + f"; {human_bytes(r.bytes_received)} received\n"
             + (f"restore it with: torpor restore -D {r.checkpoint}" if r.has_manifest else
                "an engine's checkpoint (no torpor.json): restore it with podman container "
                "restore --import (see --archive)"))


def run(args: argparse.Namespace, ctx: Context) -> int:
    args.action(args, ctx)
    return 0
