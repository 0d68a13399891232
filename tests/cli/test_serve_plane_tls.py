"""``turnout serve`` with plane credentials, as real processes: the frontend reaches its worker
over mutual TLS (the tokenizer artifact and generation both), ``turnout status`` with the same
flags lists the worker, and a raw TCP client at the worker's request-plane port gets nothing
while the worker logs the refusal."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests.certs import TestCa
from tests.integration.procs import health, start_serve, stop_serve, wait_until

from turnout.frontend.service import free_port
from turnout.runtime.request_plane.framing import Frame, FrameWriter, Kind
from turnout.runtime.request_plane.tcp import split_address


def raw_artifact_request(address: str) -> bytes:
    """Send a plaintext request for the worker's tokenizer artifact; what came back."""
    writer = FrameWriter()
    writer.append(Frame(Kind.REQUEST, 1, b"", "artifact", 0, "r"))
    data = b""
    with socket.create_connection(split_address(address), timeout=10) as sock:
        sock.sendall(writer.take())
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionError, TimeoutError):
            pass
    return data


@pytest.mark.slow
def test_serve_runs_its_planes_under_mutual_tls(tmp_path: Path) -> None:
    leaf = TestCa(tmp_path).issue("serve")
    flags = ["--plane-ca", leaf.ca, "--plane-cert", leaf.cert, "--plane-key", leaf.key]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(tmp_path, port, "--engine", "echo", "--num-workers", "1",
                       "--model-name", "echo", "--lease-ttl", "2", *flags)  # fmt: skip

    def logs() -> str:
        return (tmp_path / "serve.log").read_text(errors="replace")[-4000:]

    try:
        wait_until(lambda: len(health(url).get("echo", [])) == 1, 60, "the worker", logs)
        body = {"model": "echo", "prompt": "hello there", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", timeout=30, json=body)
        assert r.status_code == 200, r.text + logs()
        status = subprocess.run(
            [sys.executable, "-m", "turnout", "status", "--json", "--load-wait", "0",
             "--store", "file", "--store-path", str(tmp_path / "store.sqlite"), *flags],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        instances = [
            instance
            for namespace in json.loads(status.stdout)["namespaces"].values()
            for instance in namespace["instances"]
            if instance["transport"] == "tcp"
        ]
        assert instances, status.stdout
        address = instances[0]["address"]
        data = raw_artifact_request(address)
        # Nothing but, at most, a TLS alert record (content type 21): no frame, no tokenizer.
        assert not data or data[0] == 21, data[:64]
        wait_until(lambda: "refused TLS handshake from" in logs(), 30, "the refusal line", logs)
        assert "unauthenticated and unencrypted" not in logs()  # 127.0.0.1: no warning
    finally:
        stop_serve(proc)
