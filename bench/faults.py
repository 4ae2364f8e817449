"""What the reliability suite needs to poke a running `pulse serve` from outside: which process listens on
a port, its memory, the workers' view, and streaming clients that record what they saw.

Processes are found from /proc (the socket inode in /proc/net/tcp, then the process holding it in
/proc/*/fd), so nothing depends on `ss` or `lsof` being installed.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.procs import descendants

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
    first: float | None = None  # seconds from the request to its first content event
    text: str = ""  # the content deltas, joined
    finish_reason: str | None = None
    usage: dict | None = None  # the usage chunk (stream_options.include_usage)

    @property
    def complete(self) -> bool:
        """A whole stream: 200, a finish reason, [DONE], no error event."""
        return self.status == 200 and self.done and self.finish_reason is not None and not self.error_events


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float, on_data) -> StreamSeen:
    """POST `body` and read its SSE answer into a StreamSeen: a refusal's body as an error event, and each
    `data: ` payload given to `await on_data(seen, payload, t0)`."""
    seen = StreamSeen()
    t0 = time.monotonic()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            seen.status, seen.worker = r.status, r.headers.get("x-pulse-worker")
            seen.retry_after = r.headers.get("Retry-After")
            if r.status != 200:
                raw = await r.read()
                try:
                    seen.error_events.append(json.loads(raw))
                except ValueError:  # not JSON (a proxy's page, a bare 502): kept as text
                    seen.error_events.append({"raw": raw[:200].decode(errors="replace")})
            else:
                async for line in r.content:
                    seen.body_bytes += len(line)
                    if line.startswith(b"data: "):
                        await on_data(seen, line[6:].strip(), t0)
                seen.closed = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        seen.exception = type(e).__name__
    seen.ended = time.monotonic()
    seen.seconds = seen.ended - t0
    return seen


def _first_text(seen: StreamSeen, t0: float) -> None:
    if seen.first is None and seen.text:
        seen.first = time.monotonic() - t0


async def stream_chat(session: aiohttp.ClientSession, base: str, body: dict, *, on_event=None,
                      timeout_s: float = 60.0, path: str = CHAT) -> StreamSeen:
    """Stream one chat completion (or, with `path` /v1/completions, a completion) and record every kind of event;
    `on_event(seen)` runs after each one."""
    async def on_data(seen: StreamSeen, payload: bytes, t0: float) -> None:
        if payload == b"[DONE]":
            seen.done = True
            return
        event = json.loads(payload)
        if "error" in event:
            seen.error_events.append(event)
        else:
            seen.content_events += 1
            _take(seen, event)
            _first_text(seen, t0)
        if on_event is not None:
            await on_event(seen)

    return await _stream(session, base + path, body, timeout_s, on_data)


MESSAGES = "/v1/messages"


async def stream_messages(session: aiohttp.ClientSession, base: str, body: dict, *,
                          timeout_s: float = 60.0) -> StreamSeen:
    """Stream one Anthropic message (POST /v1/messages) into a StreamSeen: `message_stop` is its [DONE],
    `message_delta`'s stop_reason its finish reason and output_tokens its usage's completion_tokens, an `error`
    event an error event."""
    async def on_data(seen: StreamSeen, payload: bytes, t0: float) -> None:
        event = json.loads(payload)
        kind = event.get("type")
        if kind == "error":
            seen.error_events.append(event)
        elif kind == "content_block_delta":
            seen.content_events += 1
            seen.text += (event.get("delta") or {}).get("text") or ""
            _first_text(seen, t0)
        elif kind == "message_delta":
            seen.finish_reason = (event.get("delta") or {}).get("stop_reason") or seen.finish_reason
            seen.usage = {"completion_tokens": (event.get("usage") or {}).get("output_tokens", 0)}
        elif kind == "message_stop":
            seen.done = True

    return await _stream(session, base + MESSAGES, body, timeout_s, on_data)


def _take(seen: StreamSeen, event: dict) -> None:
    for choice in event.get("choices") or ():
        seen.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""  # chat or completions
        seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
    if event.get("usage"):
        seen.usage = event["usage"]


def worker_pid(rows: list[dict], worker_id: str) -> int:
    """The process serving `worker_id`'s token stream (the worker actor), from GET /pulse/workers rows."""
    url = next(w["url"] for w in rows if w["worker_id"] == worker_id)
    pids = listening_pids(port_of(url))
    if len(pids) != 1:
        raise RuntimeError(f"expected one process listening for {worker_id} at {url}: {pids}")
    return pids.pop()


async def _pid_when_listening(session: aiohttp.ClientSession, base: str, worker_id: str, timeout_s: float = 10.0):
    """worker_pid, retried while the gateway's row for the worker may still name a dead address."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return worker_pid(await workers(session, base), worker_id)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def child_pids(pid: int, name: str) -> list[int]:
    """The descendants of `pid` whose executable is named `name` (a worker's llama-server)."""
    out = []
    for child in descendants(pid):
        try:
            argv0 = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if Path(argv0.decode(errors="replace")).name == name:
            out.append(child)
    return out


async def both_serving(session: aiohttp.ClientSession, base: str, child: str | None = None) -> bool:
    """Both workers routable in the gateway's view (healthy, circuit closed), each where a live process listens
    (and, with `child`, with one child process of that name running under it: a killed llama-server restarted)."""
    rows = await workers(session, base)
    if len(rows) != 2 or not all(w["routable"] for w in rows):
        return False
    pids = [listening_pids(port_of(w["url"])) for w in rows]
    return all(len(p) == 1 and (not child or len(child_pids(next(iter(p)), child)) == 1) for p in pids)


async def kill_under_streams(session: aiohttp.ClientSession, base: str, bodies: list[dict], *,
                             after_events: int, timeout_s: float = 120.0,
                             child: str | None = None) -> tuple[list[StreamSeen], dict]:
    """One stream per body; once every stream has seen `after_events` content events (or 30 s passed), SIGKILL
    the worker process serving the most of them that are still running — or, with `child` (e.g.
    "llama-server"), that worker's descendant process of that name, leaving the worker alive. Returns what
    each stream saw and what was killed: {"victim", "pid", "live_on_victim", "live_elsewhere", "killed_at"
    (monotonic)}."""
    seen = [StreamSeen() for _ in bodies]
    started = [asyncio.Event() for _ in bodies]

    def waker(i: int):
        async def on_event(s: StreamSeen) -> None:
            seen[i] = s  # the live record, so the kill can see which worker each running stream is on
            if s.content_events >= after_events or s.finish_reason:
                started[i].set()
        return on_event

    async def one(i: int, body: dict) -> None:
        seen[i] = await stream_chat(session, base, body, on_event=waker(i), timeout_s=timeout_s)
        started[i].set()

    tasks = [asyncio.create_task(one(i, b)) for i, b in enumerate(bodies)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
    except asyncio.TimeoutError:
        pass  # kill anyway: some streams still wait in the admission queue
    live = Counter(s.worker for s in seen if s.worker and not s.ended)
    victim = live.most_common(1)[0][0] if live else None
    info = {"victim": victim, "live_on_victim": live.get(victim, 0),
            "live_elsewhere": sum(live.values()) - live.get(victim, 0),
            "chars_at_kill": [len(s.text) for s in seen]}  # where each stream was (text relayed so far)
    pids = {w["worker_id"]: await _pid_when_listening(session, base, w["worker_id"])
            for w in await workers(session, base)}
    if victim is not None:
        targets = child_pids(pids[victim], child) if child else [pids[victim]]
        if len(targets) != 1:
            raise RuntimeError(f"expected one {child} under {victim} (pid {pids[victim]}): {targets}")
        info["pid"] = targets[0]
        os.kill(info["pid"], signal.SIGKILL)
    info["killed_at"] = time.monotonic()
    await asyncio.gather(*tasks)
    # a second failure during the run (on a crowded box: Ray's memory monitor killing a worker) is not the
    # one-worker-killed case: say so rather than count its losses as migration's
    info["others_died"] = [w for w, pid in pids.items() if w != victim and not Path(f"/proc/{pid}").exists()]
    return seen, info


def record(name: str, figures: dict) -> None:
    """Keep a test's figures for RELIABILITY.md: bench/results/reliability/NAME.json (and print them)."""
    out = Path(__file__).resolve().parent / "results" / "reliability"
    out.mkdir(parents=True, exist_ok=True)
    doc = {"test": name, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "loadavg": [round(x, 2) for x in os.getloadavg()], **figures}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"\n{name}: {json.dumps(figures, default=str)}")
