"""What the reliability suite needs to poke a running `pulse serve` from outside: which process listens on
a port, its memory, the workers' view, and streaming clients that record what they saw.

Processes are found from /proc (the socket inode in /proc/net/tcp, then the process holding it in
/proc/*/fd), so nothing depends on `ss` or `lsof` being installed.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

MODEL = "gemma-3-270m"
CHAT = "/v1/chat/completions"
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def listening_pids(port: int) -> set[int]:
    """Processes holding a socket that listens on `port`."""
    targets = {f"socket:[{i}]" for i in listening_inodes(port)}
    pids = set()
    if not targets:
        return pids
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if str(fd.readlink()) in targets:
                    pids.add(int(proc.name))
                    break
        except OSError:  # gone, or not ours to read
            continue
    return pids


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), in bytes; 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tcp_kernel_bytes() -> int:
    """Memory the kernel holds in TCP socket buffers, box-wide (/proc/net/sockstat 'TCP: ... mem' pages)."""
    import resource

    for line in Path("/proc/net/sockstat").read_text().splitlines():
        if line.startswith("TCP:"):
            fields = line.split()
            return int(fields[fields.index("mem") + 1]) * resource.getpagesize()
    return 0


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


async def workers(session: aiohttp.ClientSession, base: str) -> list[dict]:
    """GET /pulse/workers: each worker's url, health, gateway inflight and last polled stats."""
    async with session.get(base + "/pulse/workers") as r:
        return (await r.json())["workers"]


async def health(session: aiohttp.ClientSession, base: str) -> int:
    try:
        async with session.get(base + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            await r.read()
            return r.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0


async def wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> float | None:
    """Seconds until the async predicate held, or None if it did not within timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if await predicate():
            return time.monotonic() - t0
        await asyncio.sleep(interval_s)
    return None


async def settled_idle(session: aiohttp.ClientSession, base: str, timeout_s: float = 10.0) -> float | None:
    """Seconds until every worker reports running == 0 and the gateway holds no stream (None: never)."""
    async def idle() -> bool:
        rows = await workers(session, base)
        return all(w["stats"]["running"] == 0 and w["inflight"] == 0 for w in rows)

    return await wait_until(idle, timeout_s, 0.25)


def chat_body(max_tokens: int, stream: bool = True, content: str = "go") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream}


@dataclass
class StreamSeen:
    """What one streaming client saw."""

    status: int = 0
    worker: str | None = None
    retry_after: str | None = None  # the Retry-After header of a refusal
    content_events: int = 0
    body_bytes: int = 0  # bytes of the event lines read
    error_events: list[dict] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    closed: bool = False  # the server ended the body
    exception: str | None = None
    seconds: float = 0.0
    ended: float = 0.0  # time.monotonic() when the stream ended


async def stream_chat(session: aiohttp.ClientSession, base: str, body: dict, *, on_event=None,
                      timeout_s: float = 60.0) -> StreamSeen:
    """Stream one chat completion and record every kind of event; `on_event(seen)` runs after each one."""
    seen = StreamSeen()
    t0 = time.monotonic()
    try:
        async with session.post(base + CHAT, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            seen.status, seen.worker = r.status, r.headers.get("x-pulse-worker")
            seen.retry_after = r.headers.get("Retry-After")
            if r.status != 200:
                seen.error_events.append(json.loads(await r.read()))
            else:
                async for line in r.content:
                    seen.body_bytes += len(line)
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        seen.done = True
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        seen.error_events.append(event)
                    else:
                        seen.content_events += 1
                    if on_event is not None:
                        await on_event(seen)
                seen.closed = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        seen.exception = type(e).__name__
    seen.ended = time.monotonic()
    seen.seconds = seen.ended - t0
    return seen


def record(name: str, figures: dict) -> None:
    """Keep a test's figures for RELIABILITY.md: bench/results/reliability/NAME.json (and print them)."""
    out = Path(__file__).resolve().parent / "results" / "reliability"
    out.mkdir(parents=True, exist_ok=True)
    doc = {"test": name, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "loadavg": [round(x, 2) for x in os.getloadavg()], **figures}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"\n{name}: {json.dumps(figures, default=str)}")
