"""The gateway's listening socket holds a burst of connections while its event loop is busy.

A gateway replica (gateway.app.start_server) runs in a child process that is then stopped (SIGSTOP: an event loop
that cannot accept), and 400 clients connect at once over loopback. The kernel completes the handshake of as many
as the listen backlog holds; the rest have their SYNs dropped and retried a second later, which is what a burst of
agents saw as ~1 s first tokens when aiohttp's SockSite re-listened with its default backlog of 128.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BURST = 400

CHILD = """
import asyncio, sys
from aiohttp import web
from gateway.app import start_server

async def main():
    runner, port = await start_server(web.Application(), "127.0.0.1", 0)
    print(port, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _somaxconn() -> int:
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text())
    except OSError:
        return 4096


def test_a_stopped_gateway_still_completes_a_burst_of_connections():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    socks = []
    try:
        port = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGSTOP)  # nothing accepts from here on: only the kernel's queue holds them
        for _ in range(BURST):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        pending, done = set(socks), 0
        deadline = time.monotonic() + 0.8  # under the 1 s SYN retransmit: a dropped SYN is not answered in time
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], max(0.0, deadline - time.monotonic()))
            for s in writable:
                pending.discard(s)
                done += s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        # the kernel holds backlog + 1 completed connections, capped by net.core.somaxconn
        assert done >= min(BURST, _somaxconn() + 1), f"{done} of {BURST} connections completed"
    finally:
        for s in socks:
            s.close()
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait(timeout=10)
