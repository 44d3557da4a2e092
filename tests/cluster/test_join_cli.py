"""``kvps node join`` retries while the seed cannot be reached, and stops at once on a typed,
non-retryable answer (here a refused token). No cluster: a closed port, then a tiny HTTP server."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from conftest import free_ports


class _RefuseToken(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"error": "Unauthorized", "message": "bad token"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_join_retries_an_unreachable_seed_then_stops_on_a_refused_token(tmp_path):
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvps.cli", "node", "join", "--seed", f"http://127.0.0.1:{port}",
         "--port", "1", "--data-dir", str(tmp_path / "d"), "--token", "t", "--wait", "60"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    server = None
    try:
        first = proc.stderr.readline()  # the first retry: the seed's port is closed
        assert "ConnectError: cannot reach" in first and "retrying in" in first, first
        server = ThreadingHTTPServer(("127.0.0.1", port), _RefuseToken)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        _, rest = proc.communicate(timeout=60)
        assert proc.returncode == 1
        last = rest.strip().splitlines()[-1]
        assert last.startswith("kvps node join: Unauthorized:") and "bad token" in last, rest
        assert not (tmp_path / "d").exists()  # nothing written for a join that did not happen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server is not None:
            server.shutdown()
            server.server_close()


def test_join_gives_up_after_its_wait(tmp_path):
    (port,) = free_ports(1)
    out = subprocess.run(
        [sys.executable, "-m", "kvps.cli", "node", "join", "--seed", f"http://127.0.0.1:{port}",
         "--port", "1", "--data-dir", str(tmp_path / "d"), "--token", "t", "--wait", "1"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert sum("retrying in" in line for line in lines) >= 1
    assert lines[-1].startswith("kvps node join: ConnectError: cannot reach")
