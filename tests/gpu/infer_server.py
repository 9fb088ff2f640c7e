#!/usr/bin/env python3
"""An HTTP inference server for the GPU tests: infer_program.py's random-init decoder-only
transformer (weights from a seeded CUDA generator: nothing is downloaded) behind a real TCP
listener, as a containerised inference server runs.

    POST /generate  {"prompt": "text", "max_new_tokens": 24}
      -> {"tokens": [...], "text": "...", "served": N}
    GET /health     -> {"ready": true, "served": N}

The tokenizer is local and byte-level: a prompt's UTF-8 bytes are its token ids, a generated id
is shown as the printable character of id % 95 + 32. Greedy decoding with the KV cache on the
GPU; every request starts at position 0, so the same prompt always gives the same answer, and
"served" counts the requests this process answered (host memory that must survive too). The
status file (--status) says when the model is on the GPU and which port is listened on.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import sys
import threading
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from infer_program import BATCH, MAX_LEN, Model  # noqa: E402
from program_io import write_status  # noqa: E402


class Server:
    def __init__(self, gib: float, seed: int):
        self.device = torch.device("cuda", 0)
        self.model = Model(gib, seed, self.device)
        self.lock = threading.Lock()   # one KV cache: one request on the GPU at a time
        self.served = 0

    @torch.no_grad()
    def generate(self, prompt: str, new: int) -> dict:
        ids = list(prompt.encode())[: MAX_LEN - new] or [0]
        if not 0 < new <= MAX_LEN - len(ids):
            raise ValueError(f"max_new_tokens must be 1..{MAX_LEN - len(ids)}")
        with self.lock:
            pos, out = 0, []
            for t in ids:
                logits = self.model.forward(torch.full((BATCH,), t, device=self.device), pos)
                pos += 1
            for _ in range(new):
                token = int(logits[0].argmax().item())
                out.append(token)
                logits = self.model.forward(torch.full((BATCH,), token, device=self.device),
                                            pos)
                pos += 1
            self.served += 1
            return {"tokens": out, "text": "".join(chr(t % 95 + 32) for t in out),
                    "served": self.served}


def handler(server: Server) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, {"ready": True, "served": server.served})
            else:
                self._answer(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path != "/generate":
                return self._answer(404, {"error": "not found"})
            try:
                n = int(self.headers.get("Content-Length", "0"))
                req = json.loads(self.rfile.read(min(n, 1 << 20)))
                self._answer(200, server.generate(str(req["prompt"]),
                                                  int(req.get("max_new_tokens", 24))))
            except (ValueError, KeyError, TypeError) as e:
                self._answer(400, {"error": str(e)})

        def log_message(self, *args) -> None:   # stdio is the container's: keep it quiet
            pass
    return Handler


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB of weights")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--status", required=True)
    args = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    server = Server(args.gib, args.seed)
    torch.cuda.synchronize()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler(server))
    write_status(args.status, {"ready": True, "port": args.port, "gib": args.gib,
                               "layers": len(server.model.layers)})
    httpd.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
