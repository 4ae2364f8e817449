"""Load generator for any OpenAI-compatible endpoint (aiohttp).

Closed loop (N clients, each sends its next request when the last one ends) or open loop (a fixed request
rate, in-flight capped at N). Streaming or not, chat, completions, or llama-server's native /completion
(`api="llama"`: token ids or text as the prompt, tokens counted from the final event's `timings.predicted_n`).
Per request it times:
- TTFT: from just before the request is sent to the first SSE event that carries content (role-only
  first deltas do not count: an agent feels the first text, not the headers);
- inter-token latency: gaps between successive content events;
- total duration.
A run is bounded by a request count and by time. Only loopback targets unless allow_remote: a benchmark
must not be pointed at someone else's server by accident. `procs` > 1 spreads the clients over that many
processes, started together and measured over one wall time: one event loop parsing SSE tops out near a core at
~1,000 streams, and past that the figures measure the client.

    python -m bench.loadgen --url http://127.0.0.1:8000 --clients 32 --duration 5
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import multiprocessing
import random
import re
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from urllib.parse import urlsplit

import aiohttp
import msgspec
import numpy as np

from bench import loops

PERCENTILES = (50, 90, 99)
# how long the processes of a run spread over several wait for one another: at the start (a spawned Python imports
# aiohttp, msgspec and NumPy: seconds on a busy box), and past the longest a run can last at the end
PROC_SLACK_S = 60.0


@dataclass
class LoadSpec:
    url: str  # base URL, e.g. http://127.0.0.1:8000 (the /v1/... path is added)
    api: str = "chat"  # "chat", "completions" or "llama" (llama-server's POST /completion)
    model: str = "pulse"
    prompt: str | list[int] = "Say hello."  # token ids: completions and llama only
    max_tokens: int = 16
    stream: bool = True
    clients: int = 1  # closed loop: concurrent clients; open loop: cap on requests in flight
    rate: float | None = None  # requests/s (open loop); None: closed loop
    requests: int | None = None  # stop after this many requests
    duration: float = 5.0  # stop issuing after this many seconds
    timeout: float = 30.0  # per request
    api_key: str | None = None
    allow_remote: bool = False
    body_extra: dict | None = None  # fields added to (or replacing) the request body, e.g. sampling settings
    force_close: bool = False  # a new connection per request (llama-server drops kept-alive ones under load)
    prompts: list | None = None  # when set, request i sends prompts[i % len] in place of `prompt` (no shared prefix)
    # closed loop: client i sends its first request i * stagger_s / clients seconds after the start, so the clients'
    # requests end and arrive spread over time as independent agents' do, not in lockstep (0: all at once)
    stagger_s: float = 0.0
    # closed loop: after each answer a client waits a uniform draw from [0, 2 * think_s) seconds (mean think_s, each
    # client its own seeded draws) before its next request, as an agent runs a tool between turns; 0: at once. A
    # server that takes new requests only between its steps (llama-server) gives a client that answers at once the
    # gap right after the step that ended its last request; think time puts every arrival at a random phase
    think_s: float = 0.0
    # spread the clients (and the requests) over this many processes, capped at clients: one process's event loop
    # tops out near one core at ~1,000 streams, and then limits the figures; 1: all in this process
    procs: int = 1


@dataclass
class RequestResult:
    status: int  # HTTP status; 0 when no response (connection error, timeout)
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content events
    total: float = 0.0
    tokens: int = 0
    error: str | None = None  # exception name, "stream_error" or "no_content"
    reason: str | None = None  # a refusal's message (not 200), its numbers as N: refusal_reason


def refusal_reason(body: bytes) -> str | None:
    """The message of an error answer (OpenAI's `{"error": {"message"}}`, Anthropic's `{"type": "error", "error":
    {"message"}}`, or a bare `{"detail"}`), digits folded to N so that like refusals count together ("the queue is
    full (N waiting)"), at most 160 characters; None when the body carries none."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    err = doc.get("error") if isinstance(doc, dict) else None
    msg = err.get("message") if isinstance(err, dict) else (doc.get("detail") if isinstance(doc, dict) else None)
    return re.sub(r"\d+(\.\d+)?", "N", msg)[:160] if isinstance(msg, str) and msg else None


@dataclass(frozen=True)
class _Share:
    """One process's part of a run of `clients` clients: clients first .. first + count - 1, and the run's requests
    whose index i has i % clients among them, so that no two processes send the same index i (prompts[i % len]) and
    a request budget splits as the clients do."""
    first: int
    count: int
    clients: int

    def index(self, j: int) -> int:
        """The run's index of this process's j-th request (j itself for the whole run)."""
        return j // self.count * self.clients + self.first + j % self.count

    def requests(self, total: int | None) -> int | None:
        """This process's part of a run of `total` requests: the indices below total that it owns."""
        if total is None:
            return None
        rounds, rest = divmod(total, self.clients)
        return rounds * self.count + min(max(rest - self.first, 0), self.count)


def _shares(clients: int, procs: int) -> list[_Share]:
    """`clients` split over `procs` processes as evenly as possible, in order."""
    size, extra = divmod(clients, procs)
    counts = [size + (p < extra) for p in range(procs)]
    return [_Share(sum(counts[:p]), count, clients) for p, count in enumerate(counts)]


def check_target(url: str, allow_remote: bool = False) -> None:
    """Refuse anything but loopback unless allowed; raises ValueError naming the host."""
    host = urlsplit(url).hostname
    if not host:
        raise ValueError(f"no host in URL {url!r}")
    if allow_remote:
        return
    try:
        addrs = {ipaddress.ip_address(host)}
    except ValueError:
        infos = socket.getaddrinfo(host, None)
        addrs = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    if not addrs or not all(a.is_loopback for a in addrs):
        raise ValueError(f"{host} is not a loopback address; pass --allow-remote to load a remote server")


def request_body(spec: LoadSpec) -> tuple[str, dict]:
    if spec.api == "llama":
        body = {"prompt": spec.prompt, "n_predict": spec.max_tokens, "stream": spec.stream, "temperature": 0,
                "cache_prompt": True}
        return "/completion", body | (spec.body_extra or {})
    if spec.api == "chat":
        if not isinstance(spec.prompt, str):
            raise ValueError("a chat prompt must be text, not token ids")
        body = {"model": spec.model, "messages": [{"role": "user", "content": spec.prompt}]}
        path = "/v1/chat/completions"
    elif spec.api == "completions":
        body = {"model": spec.model, "prompt": spec.prompt}
        path = "/v1/completions"
    else:
        raise ValueError(f"api must be chat, completions or llama, not {spec.api!r}")
    body.update(max_tokens=spec.max_tokens, stream=spec.stream, temperature=0)
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    return path, body | (spec.body_extra or {})


def nth_body(spec: LoadSpec, body: dict, i: int) -> dict:
    """The body of the run's i-th request: `body`, with the i-th of spec.prompts when there are several."""
    if not spec.prompts:
        return body
    prompt = spec.prompts[i % len(spec.prompts)]
    if spec.api == "chat":
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


def event_content(event: dict) -> tuple[str, int | None]:
    """(text carried by one OpenAI or llama-server stream event, completion_tokens if it carries usage).

    llama-server's events have no `choices`: text in `content`, and the final one (`stop: true`) says how many
    tokens were generated in `timings.predicted_n` (one event may carry several tokens).
    """
    if "choices" not in event and "content" in event:
        timings = event.get("timings") if event.get("stop") else None
        return event["content"] or "", (timings.get("predicted_n") if timings else None)
    text = ""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        text += (delta.get("content") or "") if delta else (choice.get("text") or "")
    usage = event.get("usage")
    return text, (usage.get("completion_tokens") if usage else None)


async def _read_stream(resp: aiohttp.ClientResponse, t0: float, res: RequestResult) -> None:
    last = None
    events = 0
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = msgspec.json.decode(data)
        if "error" in event:
            res.error = "stream_error"
            continue
        text, usage_tokens = event_content(event)
        if usage_tokens is not None:
            res.tokens = usage_tokens
        if text:
            now = time.perf_counter()
            events += 1
            if last is None:
                res.ttft = now - t0
            else:
                res.itl.append(now - last)
            last = now
    if not res.tokens:
        res.tokens = events  # no usage event: one content event per token is the best estimate
    if res.ttft is None and res.error is None:
        res.error = "no_content"


async def one_request(session: aiohttp.ClientSession, url: str, body: dict, stream: bool) -> RequestResult:
    res = RequestResult(status=0)
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.reason = refusal_reason(await resp.read())
            elif stream:
                await _read_stream(resp, t0, res)
            else:
                doc = await resp.json()
                res.ttft = time.perf_counter() - t0
                _, usage_tokens = event_content(doc) if "choices" not in doc else (None, None)
                res.tokens = usage_tokens or (doc.get("usage") or {}).get("completion_tokens", 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
        res.error = type(exc).__name__
    res.total = time.perf_counter() - t0
    return res


async def run_load(spec: LoadSpec) -> dict:
    """Run one bounded load; returns the aggregate (see `aggregate`). With spec.procs > 1 the load is sent from
    that many processes (`_run_procs`), this one only waits for them."""
    check_target(spec.url, spec.allow_remote)
    if min(spec.procs, spec.clients) > 1:
        results, wall, cpu = await asyncio.to_thread(_run_procs, spec, loops.loop_name(asyncio.get_running_loop()))
    else:
        results, wall, cpu = await _load(spec)
    out = aggregate(results, wall)
    # the load generator's own CPU over the run, in cores, summed over its processes: near 1 per process their event
    # loops are the bottleneck, and the figures measure the client as much as the server
    out["metrics"]["client_cpu"] = cpu / wall if wall > 0 else None
    return out


async def _load(spec: LoadSpec, share: _Share | None = None, ready: Callable[[], None] | None = None,
                done: Callable[[], None] | None = None) -> tuple[list[RequestResult], float, float]:
    """(results, wall s, CPU s) of `share`'s requests (None: the whole run) sent from this process. `ready` is
    called once the session is open and returns at the start (every process's), `done` just after the end."""
    path, body = request_body(spec)
    url = spec.url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    timeout = aiohttp.ClientTimeout(total=spec.timeout)
    connector = aiohttp.TCPConnector(limit=spec.clients, force_close=spec.force_close)
    results: list[RequestResult] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        if ready:
            ready()  # blocks this event loop on purpose: nothing else runs in it yet
        start, cpu = time.perf_counter(), time.process_time()
        if spec.rate:
            await _open_loop(spec, session, url, body, start, results, share)
        else:
            await _closed_loop(spec, session, url, body, start, results, share)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        if done:
            done()
    return results, wall, cpu


def _longest_run(spec: LoadSpec) -> float:
    """Seconds a run can last at most, with slack: issuing stops at `duration` (or once the last staggered client
    wakes), and the last request ends within `timeout`."""
    return spec.duration + spec.stagger_s + spec.timeout + PROC_SLACK_S


def _run_procs(spec: LoadSpec, loop: str) -> tuple[list[RequestResult], float, float]:
    """(results, wall s, CPU s summed) of the run spread over min(procs, clients) processes, each with its share
    of the clients and of the requests, on a `loop` event loop. Spawned, not forked: no copy of the caller's event
    loop and threads. They start together once each has its session open, so start-up is not in the wall time,
    which runs from that start to the end of the last one's last request."""
    request_body(spec)  # a bad spec fails here, as a ValueError, rather than in every process
    shares = _shares(spec.clients, min(spec.procs, spec.clients))
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    pipes = [ctx.Pipe(duplex=False) for _ in shares]
    procs = [ctx.Process(target=_proc_main, daemon=True,
                         args=(replace(spec, requests=share.requests(spec.requests)), share, go, send, loop))
             for share, (_, send) in zip(shares, pipes)]
    for proc in procs:
        proc.start()
    try:
        for _, send in pipes:
            send.close()  # the processes hold theirs: one that dies then reads as EOF at once
        for recv, _ in pipes:
            _receive(recv, PROC_SLACK_S)  # "ready"
        go.set()
        start = time.perf_counter()
        for recv, _ in pipes:
            _receive(recv, _longest_run(spec))  # "done"
        wall = time.perf_counter() - start
        answers = [_receive(recv, PROC_SLACK_S) for recv, _ in pipes]
    except BaseException:
        for proc in procs:
            proc.terminate()  # one failed: the others' load is void
        raise
    finally:
        for proc in procs:
            proc.join(PROC_SLACK_S)
    return [r for results, _ in answers for r in results], wall, sum(cpu for _, cpu in answers)


def _receive(recv, timeout: float):
    """A load process's next message; raises where it failed (its exception), exited or said nothing in time."""
    if not recv.poll(timeout):
        raise RuntimeError(f"a load process said nothing in {timeout:.0f} s")
    try:
        got = recv.recv()
    except EOFError:
        raise RuntimeError("a load process exited without an answer") from None
    if isinstance(got, Exception):
        raise got
    return got


def _proc_main(spec: LoadSpec, share: _Share, go, send, loop: str) -> None:
    """One load process: says "ready" once its session is open and starts at `go`, says "done" once its last
    request has ended, then sends its share's (results, CPU s); or the exception it failed with."""
    def ready() -> None:
        send.send("ready")
        if not go.wait(PROC_SLACK_S):
            raise TimeoutError(f"no start in {PROC_SLACK_S:.0f} s")

    try:
        results, _, cpu = loops.run(_load(spec, share, ready, lambda: send.send("done")), loop)
    except BaseException as exc:
        send.send(RuntimeError(f"a load process failed: {type(exc).__name__}: {exc}"))
        raise
    send.send((results, cpu))


def _budget(spec: LoadSpec, start: float, issued: int) -> bool:
    within_count = spec.requests is None or issued < spec.requests
    return within_count and time.perf_counter() - start < spec.duration


async def _closed_loop(spec, session, url, body, start, results, share: _Share | None = None) -> None:
    """`share`'s clients (None: all), each by its index in the whole run for the stagger; `spec.requests` is the
    share's budget."""
    share = share or _Share(0, spec.clients, spec.clients)
    issued = 0

    async def client(i: int) -> None:
        nonlocal issued
        if spec.stagger_s > 0:
            await asyncio.sleep(i * spec.stagger_s / spec.clients)
        draws = random.Random(i)
        while _budget(spec, start, issued):
            issued += 1
            results.append(await one_request(session, url, nth_body(spec, body, share.index(issued - 1)),
                                             spec.stream))
            if spec.think_s > 0 and _budget(spec, start, issued):
                await asyncio.sleep(draws.uniform(0.0, 2.0 * spec.think_s))

    await asyncio.gather(*(client(i) for i in range(share.first, share.first + share.count)))


async def _open_loop(spec, session, url, body, start, results, share: _Share | None = None) -> None:
    """`share`'s requests (None: all), each sent when the whole run's rate would send it; `spec.requests` is the
    share's budget."""
    share = share or _Share(0, spec.clients, spec.clients)
    gate = asyncio.Semaphore(share.count)
    tasks = []

    async def fire(i: int) -> None:
        async with gate:
            results.append(await one_request(session, url, nth_body(spec, body, i), spec.stream))

    issued = 0
    while _budget(spec, start, issued):
        i = share.index(issued)
        # schedule by the clock, not by sleeps added up, so the rate does not drift
        delay = start + i / spec.rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fire(i)))
        issued += 1
    await asyncio.gather(*tasks)


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99 in ms (scale) of seconds; None where there are no values."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    qs = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {f"p{p}": float(q) * scale for p, q in zip(PERCENTILES, qs)}


def _served(r: RequestResult) -> bool:
    return r.status == 200 and r.error is None


def aggregate(results: Sequence[RequestResult], wall: float) -> dict:
    """Counts, rates and percentiles (ms) of one run. Only complete 200 answers count as served."""
    ok = [r for r in results if _served(r)]
    statuses = Counter(str(r.status) if r.status else "none" for r in results)
    errors = Counter(r.error or str(r.status) for r in results if not _served(r) and r.status != 429)
    tokens = sum(r.tokens for r in ok)
    flat = {
        "requests": len(results),
        "ok": len(ok),
        "rate_limited": statuses.get("429", 0),
        "errors": sum(errors.values()),
        "wall_s": wall,
        "req_s": len(ok) / wall if wall > 0 else 0.0,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        # content events a client parsed per answer (a server may put several tokens in one)
        "events_per_req": sum(len(r.itl) + 1 for r in ok if r.ttft is not None) / len(ok) if ok else None,
    }
    for name, values in (("ttft", [r.ttft for r in ok if r.ttft is not None]),
                         ("itl", [g for r in ok for g in r.itl]),
                         ("total", [r.total for r in ok])):
        for p, v in percentiles(values).items():
            flat[f"{name}_{p}_ms"] = v
    # why answers were refused, by status and message: the 429s past saturation say which limit they met
    refusals = Counter(f"{r.status}: {r.reason}" for r in results if r.status not in (0, 200) and r.reason)
    return {"metrics": flat, "status_counts": dict(statuses), "error_kinds": dict(errors),
            "refusals": dict(refusals)}


def _parse(argv: Sequence[str] | None) -> tuple[str, LoadSpec]:
    ap = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--api", choices=["chat", "completions", "llama"], default="chat")
    ap.add_argument("--model", default="pulse")
    ap.add_argument("--prompt", default="Say hello.")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--rate", type=float, default=None, help="requests/s, open loop (default: closed loop)")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--think-s", type=float, default=0.0, help=(
        "closed loop: a client's mean wait between an answer and its next request (uniform, 0 to twice it)"))
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--allow-remote", action="store_true")
    ap.add_argument("--procs", type=int, default=1, help=(
        "processes to spread the clients over (one tops out near a core at ~1,000 streams)"))
    ap.add_argument("--loop", choices=loops.CHOICES, default="auto", help="event loop (auto: uvloop if installed)")
    args = vars(ap.parse_args(argv))
    return args.pop("loop"), LoadSpec(**args)


def main(argv: Sequence[str] | None = None) -> int:
    loop, spec = _parse(argv)
    try:
        out = loops.run(run_load(spec), loop)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec_doc = asdict(spec)
    spec_doc.pop("api_key")  # never print a key
    print(json.dumps({"spec": spec_doc, **out}, indent=1))
    return 0 if out["metrics"]["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
