"""The load suite's clients, run as a fresh process of another uid (test_sidecar_load.py starts
them as root with `python -c`, this text and the uid first; they become that uid at once: no
uid but root has to read the worktree, and no gRPC state crosses a fork). One JSON line on
stdout at the end, what they saw.

    hold PATH N SECONDS     open N connections to PATH, keep them SECONDS, then count: served
                            (the gRPC server's first bytes came, still open), closed (refused or
                            shed: EOF) and silent (open, nothing came)
    flood PATH SECONDS      connect and close as fast as it goes, SECONDS long
    rpcs PATH N CHANNELS    N Status calls at once over CHANNELS connections (a line "ready"
                            once they are connected); counts by status
    call PATH               one Status call (its status; exit 0 when OK)
    echo PATH N SECONDS     N connections to an echo server behind PATH, each sending "ping":
                            how many got it back (a line at once), then held SECONDS
"""

from __future__ import annotations

import collections
import json
import os
import resource
import socket
import sys
import time


def _nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _state(s: socket.socket) -> str:
    """served: open, the gRPC server's bytes came; closed: EOF (refused or shed, after
    whatever came first); silent: open, nothing came."""
    s.setblocking(False)       # a timeout socket would poll first, MSG_DONTWAIT or not
    got = False
    while True:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            return "served" if got else "silent"
        except OSError:        # ECONNRESET: closed with bytes unread
            return "closed"
        if not data:
            return "closed"
        got = True


def hold(path: str, n: int, seconds: float) -> dict:
    t0 = time.monotonic()
    held, errors = [], collections.Counter()
    for _ in range(n):
        if time.monotonic() - t0 > seconds:     # connects that hang: torpord stopped accepting
            errors["late"] += n - len(held) - sum(errors.values())
            break
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(path)
        except OSError as e:
            errors[e.__class__.__name__] += 1
            s.close()
            continue
        held.append(s)
    opened = time.monotonic() - t0
    time.sleep(max(0.0, seconds - opened))
    seen = collections.Counter(_state(s) for s in held)
    return {"opened": len(held), "open_s": round(opened, 2), "errors": dict(errors), **seen}


def flood(path: str, seconds: float) -> dict:
    deadline, n, errors = time.monotonic() + seconds, 0, collections.Counter()
    while time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1)
        try:
            s.connect(path)
            n += 1
            s.recv(1)
        except OSError as e:
            errors[e.__class__.__name__] += 1
        s.close()
    return {"connects": n, "errors": dict(errors)}


def _stub(path: str):
    import grpc
    from torpor.sidecar import proto
    pb, pb_grpc = proto()
    channel = grpc.insecure_channel(f"unix://{path}", options=[
        ("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)])
    return pb, channel, pb_grpc.TorporStub(channel)


def rpcs(path: str, n: int, channels: int) -> dict:
    import grpc
    stubs = [_stub(path) for _ in range(channels)]
    for _pb, ch, _s in stubs:
        grpc.channel_ready_future(ch).result(timeout=30)
    print("ready", flush=True)         # connected: the caller may start the other floods
    t0 = time.monotonic()
    futures = [stub.Status.future(pb.StatusRequest(pids=[os.getpid()]), timeout=120)
               for i in range(n) for pb, _ch, stub in [stubs[i % channels]]]
    codes, details = collections.Counter(), {}
    for f in futures:
        try:
            f.result()
            codes["OK"] += 1
        except Exception as e:       # grpc.RpcError: its status
            code = e.code().name if hasattr(e, "code") else repr(e)[:80]
            codes[code] += 1
            details.setdefault(code, e.details() if hasattr(e, "details") else "")
    for _pb, ch, _stub_ in stubs:
        ch.close()
    return {"codes": dict(codes), "details": details, "seconds": round(time.monotonic() - t0, 2)}


def call(path: str) -> dict:
    pb, ch, stub = _stub(path)
    try:
        stub.Status(pb.StatusRequest(pids=[os.getpid()]), timeout=10)
        return {"code": "OK"}
    except Exception as e:
        return {"code": e.code().name if hasattr(e, "code") else repr(e)[:200]}
    finally:
        ch.close()


def echo(path: str, n: int, seconds: float) -> dict:
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(path)
            s.sendall(b"ping")
            if s.recv(4) == b"ping":
                held.append(s)
                continue
        except OSError:
            pass
        s.close()
    print(json.dumps({"served": len(held)}), flush=True)
    time.sleep(seconds)
    return {"served": len(held)}


def _become(uid: int) -> None:
    """Drop root for uid here, not in subprocess.Popen(user=...): that makes CPython fork()
    rather than vfork(), which runs gRPC's pthread_atfork handlers in the test process (they
    stop and restart its gRPC threads while its calls are in flight)."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


if __name__ == "__main__":
    _become(int(sys.argv[1]))
    _nofile()
    mode, path, *rest = sys.argv[2:]
    fn = {"hold": hold, "flood": flood, "rpcs": rpcs, "call": call, "echo": echo}[mode]
    args = [float(a) if "." in a else int(a) for a in rest]
    out = fn(path, *args)
    print(json.dumps(out), flush=True)
    sys.exit(0 if mode != "call" or out["code"] == "OK" else 1)
