"""CPU of per-request pieces of the gateway's hot path, with and without their cheaper form.

- spans: a request's root span plus three child spans (auth, admission, route) and the trace context sent to
  the worker, with no exporter configured: the SDK tracer against QuietTracer (workers/protocol/spans.py);
- deltas: 16 streamed text deltas of a chat completion, each chunk built and JSON-encoded whole against
  ChatEvents' pre-encoded frame around the text (gateway/completions.py);
- worker leg: one generate request of 16 tokens to a real StreamServer (load-test backend) in this process,
  read to its end by aiohttp's client (as the gateway did: ClientSession.post, iter_any, split and decode each
  line) against gateway/channel.py; the server's own CPU is in both figures alike.

Process CPU time per request-equivalent; median and min/max over repeats, interleaved.

    python -m bench.gateway_hotpath [--repeats 7] [--n 3000]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence


def cases() -> dict[str, Callable[[], object]]:
    from gateway.completions import ChatEvents, _event
    from gateway.responses import Shaper
    from policy.config import TelemetryConfig
    from workers.protocol import telemetry as tm
    from workers.protocol.spans import QuietTracer

    raw = tm.setup_tracing(TelemetryConfig(traces_exporter="none"), "gateway", set_global=False).get_tracer("bench")
    shaper = Shaper("chat", "chatcmpl-0123456789abcdef", 1_700_000_000, "gemma-3-270m", str)

    def spans(tracer) -> None:
        with tracer.start_as_current_span("POST /v1/chat/completions", context=tm.extract_context({}),
                                          kind=tm.trace.SpanKind.SERVER):
            for name in ("pulse.admission.auth", "pulse.admission", "pulse.route"):
                with tracer.start_as_current_span(name) as span:
                    span.set_attribute("pulse.worker", "w0")
            tm.inject_context()

    def framed() -> list[bytes]:
        events = ChatEvents(shaper, include_usage=False)
        return [events.delta(f" t{i}", None, False) for i in range(16)]

    return {"spans, SDK tracer": lambda: spans(raw), "spans, QuietTracer": lambda: spans(QuietTracer(raw)),
            "16 deltas, whole chunk": lambda: [_event(shaper.stream_chunk(f" t{i}", None, None, False))
                                               for i in range(16)],
            "16 deltas, framed": framed,
            "worker leg, aiohttp": lambda: LEG.run("aiohttp"), "worker leg, channel": lambda: LEG.run("channel")}


class _WorkerLeg:
    """A load-test StreamServer on loopback and both clients of it, on an event loop of its own, made on first use
    (listing the cases starts nothing)."""

    def __init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None

    def run(self, client: str) -> int:
        if self.loop is None:
            try:
                import uvloop

                self.loop = uvloop.new_event_loop()  # the gateway's loop (Ray Serve runs replicas on uvloop)
            except ImportError:
                self.loop = asyncio.new_event_loop()
            self.loop.run_until_complete(self._start())
        return self.loop.run_until_complete(self._aiohttp() if client == "aiohttp" else self._channel())

    async def _start(self) -> None:
        import aiohttp

        from gateway.channel import Channels
        from policy.config import PulseConfig
        from workers.loadtest import LoadTestBackend
        from workers.protocol import GenerateRequest, encode
        from workers.stream import StreamServer

        config = PulseConfig.model_validate({"workers": {"backend": "loadtest", "loadtest": {"tokens": 16}}})
        self.server = StreamServer(LoadTestBackend(config, worker_id="w0"), worker_id="w0")
        self.url = await self.server.start()
        self.body = encode(GenerateRequest(request_id="r", prompt_ids=[1, 2, 3], max_tokens=16))
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                                             auto_decompress=False)
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60)
        self.channels = Channels()

    async def _aiohttp(self) -> int:
        from workers.protocol import chunk_decoder

        resp = await self.session.post(self.url + "/generate", data=self.body, timeout=self.timeout,
                                       headers={"Content-Type": "application/json",
                                                "Authorization": f"Bearer {self.server.secret}"})
        tail, n = b"", 0
        async for data in resp.content.iter_any():
            *lines, tail = (tail + data).split(b"\n")
            n += len([chunk_decoder.decode(line) for line in lines if line.strip()])
        resp.close()
        return n

    async def _channel(self) -> int:
        stream = await self.channels.open(self.url, "/generate", self.body, self.server.secret)
        n = 0
        async for batch in stream.batches():
            n += len(batch)
        stream.close()
        return n

    def close(self) -> None:
        if self.loop is not None:
            self.loop.run_until_complete(self._stop())
            self.loop.close()
            self.loop = None

    async def _stop(self) -> None:
        await self.session.close()
        await self.channels.close()
        await self.server.close()


LEG = _WorkerLeg()


def cpu_us(fn: Callable[[], object], n: int) -> float:
    fn()
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway_hotpath", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--n", type=int, default=3000, help="calls per timing")
    args = ap.parse_args(argv)
    runs = cases()
    got: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for _ in range(args.repeats):
            for name, fn in runs.items():
                got[name].append(cpu_us(fn, args.n))
    finally:
        LEG.close()
    for name, values in got.items():
        print(f"{name:24s} {statistics.median(values):7.1f} us CPU per request ({min(values):.1f}-{max(values):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
