"""Running a server from Python: in this process (uvicorn in a thread, for tests) or as an
`asynct serve` subprocess (for benchmarks, so the load generator does not share its GIL)."""
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from asynct.entrypoints.serve.limits import ServerLimits


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_socket(host: str, port: int):
    """A server's listening socket (IPv6 for an IPv6 address). `asynct serve` binds it before the
    model loads: a port in use failed only once the model had loaded (minutes on a GPU; or, beside
    the server holding the port and the GPU, with 'no room for a KV cache')."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread; `with ServerThread(app) as url:`."""

    def __init__(self, app, host: str = "127.0.0.1"):
        import uvicorn

        from asynct.entrypoints.serve.api_server import Server
        self.sock = listen_socket(host, 0)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, backlog=4096,
                                **connection_options(app))
        self.server = Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def connection_options(app) -> dict:
    """uvicorn's settings for the app's ServerLimits."""
    limits = getattr(app.state, "limits", None) or ServerLimits()
    return {"http": guarded_protocol(limits), "timeout_keep_alive": limits.keep_alive_timeout}


def guarded_protocol(limits: ServerLimits):
    """uvicorn's HTTP protocol plus what it lacks: a deadline for each request's headers, and a
    cap on open connections (each holds a file descriptor, slow or not)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class GuardedProtocol(Base):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.deadline_for = None
            if len(self.connections) > limits.max_connections:
                transport.close()
            else:
                self._expect_request()

        def data_received(self, data):
            # the first bytes of a next request on a kept-alive connection start its clock (an idle
            # connection is uvicorn's keep-alive timeout's to close)
            if self.cycle is not None and self.cycle.response_complete and self.deadline_for is not self.cycle:
                self._expect_request()
            super().data_received(data)

        def _expect_request(self):
            # a new request replaces self.cycle once its headers are in
            self.deadline_for = self.cycle
            self.loop.call_later(limits.header_timeout, self._request_due, self.cycle)

        def _request_due(self, cycle):
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


class ServerProcess:
    """`python -m asynct.entrypoints.cli serve MODEL ...` on a free port; waits for /health."""

    def __init__(self, model: str, *args: str, port: int | None = None, env: dict | None = None,
                 timeout: float = 600):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "asynct.entrypoints.cli", "serve", str(model), "--port", str(self.port),
                    "--log-level", "warning", *args]
        # the child imports this very asynct, installed or not
        root = str(Path(__file__).resolve().parents[3])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        self.timeout, self.proc = timeout, None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.cmd, env=self.env)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"asynct serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.__exit__()
        raise RuntimeError("asynct serve did not come up in time")

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
