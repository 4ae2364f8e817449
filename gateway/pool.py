"""The gateway's view of the workers: where each one's token stream is, its live load, its health.

Tokens do not cross Ray: each worker serves its stream over a direct HTTP channel (workers/stream.py)
and the gateway keeps pooled keep-alive connections to it (gateway/channel.py), sending the worker's channel
secret (from its WorkerInfo, which came through Ray) on every request. The periodic /stats and /blocks
polls go through an aiohttp session. Ray only tells the gateway where the workers
are (`discover`), restarts dead ones, and places them.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from gateway.channel import Channels, WorkerStream
from policy.types import load_fields
from workers.protocol import (
    BackendError,
    BackendStats,
    BlockBatch,
    Chunk,
    GenerateRequest,
    WorkerInfo,
    encode,
    stats_decoder,
)

log = logging.getLogger("pulse.gateway.pool")
# the stats poll's interval while requests wait for places (WorkerPool.poll_delay); a stats answer is small, and only
# gateways with a queue poll this often
BUSY_POLL_S = 0.05
block_batch_decoder = msgspec.json.Decoder(BlockBatch)

Discover = Callable[[str | None], Awaitable[list[WorkerInfo]]]


@dataclass
class WorkerState:
    info: WorkerInfo
    stats: BackendStats = field(default_factory=BackendStats)
    inflight: int = 0  # requests this gateway has routed there and not yet closed (opened/closed keep it)
    # Of the polled stats' running + waiting, how many were this gateway's own, taken as its peak in-flight
    # count from the poll before to this poll's answer: the worker's figure may be older than its answer (a
    # backend may report what it sampled a little earlier), so a request that ended just before the poll may
    # still be in it.
    # Routing counts the worker's load as (polled - polled_own) + inflight: other replicas' requests as last
    # polled, its own as of now. Overcounting its own hides others' requests until the next poll at most.
    polled_own: int = 0
    inflight_peak: int = 0  # the peak since the last poll was sent
    pending_prefill: int = 0  # uncached prompt tokens sent there that have not produced a first chunk yet
    healthy: bool = True
    # it answered 429 (no room: this gateway's view of it was stale, e.g. another replica took the place it saw
    # free) since the last poll: admission counts it full, so requests wait in the queue until the next poll
    refused: bool = False
    failures: int = 0  # consecutive failures (circuit breaker)
    open_until: float = 0.0  # circuit open: not routed to before this time
    last_seen: float = 0.0
    block_seq: int = 0  # last block event pulled from this worker (in-process prefix index only)
    _load_fields: tuple = field(default=(None, {}), repr=False)  # (the stats they came from, the fields)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def routable(self, now: float) -> bool:
        return self.healthy and now >= self.open_until

    def opened(self) -> None:
        """This gateway sent the worker a request (counts at once, before the worker's next stats)."""
        self.inflight += 1
        self.inflight_peak = max(self.inflight_peak, self.inflight)

    def closed(self) -> None:
        """The request ended (or was refused): it stops counting at once, though the last poll saw it."""
        self.inflight -= 1

    def load_fields(self) -> dict:
        """The last stats as WorkerLoad's fields, worked out once per reading (routing asks on every request;
        the stats change with each poll)."""
        if self._load_fields[0] is not self.stats:
            self._load_fields = (self.stats, load_fields(self.stats))
        return self._load_fields[1]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.info.secret}"}


class WorkerPool:
    """Worker addresses, load and health; opens token streams.

    `discover(worker_id or None)` returns WorkerInfo for all workers (None) or for one worker whose
    channel failed (after a restart its address changes).
    """

    def __init__(self, discover: Discover, *, poll_interval_s: float = 0.5, first_byte_timeout_s: float = 60.0,
                 breaker_threshold: int = 3, breaker_open_s: float = 5.0, block_index=None,
                 sync_blocks: bool = False, busy_poll_s: float = BUSY_POLL_S):
        self._discover = discover
        self.block_index = block_index  # an in-process PrefixIndex fed from the workers' block logs
        self.sync_blocks = sync_blocks  # see fresh_blocks; False: the poll alone feeds the index
        self._blocks_at = 0.0  # when the last pull of every worker's block log started (monotonic)
        self._blocks_pull: asyncio.Future | None = None  # the pull in flight, shared by all who wait for it
        self._poll_interval = poll_interval_s
        self._busy_poll = min(busy_poll_s, poll_interval_s)
        self._first_byte_timeout = first_byte_timeout_s
        self._breaker_threshold, self._breaker_open_s = breaker_threshold, breaker_open_s
        self.workers: dict[str, WorkerState] = {}
        self._session: aiohttp.ClientSession | None = None
        self._channels = Channels(connect_timeout_s=5, read_timeout_s=first_byte_timeout_s)
        self._poller: asyncio.Task | None = None
        self._rediscovering: set[str] = set()
        # how this gateway names itself to the workers, and how many requests wait in its admission queue (set by
        # whoever owns the queue): each poll tells the workers, so that replicas share their places by demand
        self.gateway_id = secrets.token_hex(8)
        self.queue_depth: Callable[[], int] = lambda: 0
        # whether this gateway's queue waits for what only the workers' next stats show (set by whoever owns the
        # queue: AdmissionGate.needs_stats); unset: whenever anything waits in it
        self.queue_needs_stats: Callable[[], bool] = lambda: self.queue_depth() > 0
        # per worker id, its queue's first request for that worker: (priority, seconds waited) (AdmissionGate.heads)
        self.queue_heads: Callable[[], dict[str, tuple[int, float]]] = dict
        self.on_polled: Callable[[], None] = lambda: None  # after each stats poll (the queue's head re-checks)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True,
                                         socket_factory=_bounded_socket)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        for info in await self._discover(None):
            self.workers[info.worker_id] = WorkerState(info)
        await self.poll_once()
        self._poller = asyncio.create_task(self._poll_loop())

    async def close(self) -> None:
        if self._poller:
            self._poller.cancel()
        if self._session:
            await self._session.close()
        await self._channels.close()

    def routable(self) -> list[WorkerState]:
        now = time.monotonic()
        return [w for w in self.workers.values() if w.routable(now)]

    def any_healthy(self) -> bool:
        return any(w.healthy for w in self.workers.values())

    async def _poll_loop(self) -> None:
        blocks_due = time.monotonic() + self._poll_interval
        while True:
            await asyncio.sleep(self.poll_delay())
            try:
                # the block logs at the plain interval only: a busy poll is for the places, not the index
                now = time.monotonic()
                pull = now >= blocks_due
                await self.poll_once(blocks=pull)
                if pull:
                    blocks_due = now + self._poll_interval
                self.on_polled()
            except Exception:  # the poller must outlive any one bad reading
                log.exception("worker poll failed")

    @property
    def poll_interval_s(self) -> float:
        return self._poll_interval

    def poll_delay(self) -> float:
        """Seconds until the next stats poll: `busy_poll_s` while requests wait for what only the workers' stats
        show (`queue_needs_stats`: this gateway's queue, when its head waits for a place another replica's
        request holds, for KV or on a refusal), while other replicas' requests wait (as the workers last said), or
        when a worker refused one since its last poll; else `poll_interval_s`. While requests wait, a place freed
        by another replica's request, or left free by this one over its share (policy.admission.over_share), is
        seen only at this gateway's next poll: at the plain 0.5 s the workers' places stood partly empty past
        saturation (the load-test backend on the 2-core box, 64 places + 32 queued and 400 clients over 4
        replicas: 205 req/s against 216 at 0.05 s; BENCHMARKS.md, issue 25). A queue that waits only for places
        this gateway's own requests hold is woken by their ends (AdmissionGate.leave), so polling for it was
        waste: on the 2-core box, 32 clients on llama-server's 4 slots, the busy poll cost 1.1% of a core in the
        gateway and 0.8% in the worker, CPU taken from llama-server. Idle, a gateway polls at the plain
        interval."""
        busy = self.queue_needs_stats() or any(w.refused or w.stats.gateways_waiting > 0
                                                for w in self.workers.values())
        return self._busy_poll if busy else self._poll_interval

    async def poll_once(self, blocks: bool = True) -> None:
        heads = self.queue_heads()
        await asyncio.gather(*(self._poll(w, heads=heads) for w in list(self.workers.values())))
        if blocks and self.block_index is not None:
            await self._sync_blocks()

    async def fresh_blocks(self) -> None:
        """Return once a pull of every worker's new block events that started after this call has ended.

        Several gateway replicas without Redis each keep their own in-process index, fed by this pull; a
        conversation's next turn may land on a replica that did not route its last one, and only the index
        tells it which worker holds the conversation's blocks. The last turn's events were in its worker's
        log before its answer reached the client, so before this turn reached the gateway: a pull that
        started later has them, one that started earlier (the poll's, or one still in flight) may not. Those
        who ask while a pull is in flight share the one that follows it: at most one pull runs at a time."""
        if self.block_index is None or not self.sync_blocks:
            return
        asked = time.monotonic()
        while self._blocks_at < asked or self._blocks_pull is not None:
            if self._blocks_pull is None:
                self._start_pull()
            pull, started = self._blocks_pull, self._blocks_at
            await asyncio.shield(pull)
            if started >= asked:
                return

    async def _sync_blocks(self) -> None:
        """The poll's pull: join the one in flight or start one."""
        if self._blocks_pull is None:
            self._start_pull()
        await asyncio.shield(self._blocks_pull)

    def _start_pull(self) -> None:
        self._blocks_at = time.monotonic()
        self._blocks_pull = asyncio.ensure_future(self._pull_all_blocks())
        self._blocks_pull.add_done_callback(self._pull_done)

    def _pull_done(self, fut: asyncio.Future) -> None:
        self._blocks_pull = None

    async def _pull_all_blocks(self) -> None:
        workers = [w for w in self.workers.values() if w.healthy]
        for w, result in zip(workers, await asyncio.gather(*(self._pull_blocks(w) for w in workers),
                                                           return_exceptions=True)):
            if isinstance(result, Exception):  # the stats poll judges health; the index is only a hint
                log.debug("block pull from %s failed: %s", w.worker_id, result)

    async def _poll(self, w: WorkerState, rediscover: bool = True, heads: dict | None = None) -> None:
        """Refresh one worker's load and health (and its block events); a failure marks it unhealthy and,
        unless this poll is itself part of a rediscovery, looks the worker up again. It tells the worker this
        gateway's queue: its depth and, where one waits for this worker, its head's priority and wait."""
        assert self._session is not None
        before, w.inflight_peak = w.inflight_peak, w.inflight  # see WorkerState.polled_own
        try:
            url = f"{w.info.url}/stats?gateway={self.gateway_id}&waiting={self.queue_depth()}"
            head = (heads or {}).get(w.worker_id)
            if head is not None:
                url += f"&head={head[0]}:{round(head[1] * 1e3)}"
            async with self._session.get(url, headers=w.auth, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status != 200:
                    raise BackendError(f"stats answered {r.status}")
                w.stats = stats_decoder.decode(await r.read())
            w.polled_own = max(before, w.inflight_peak)
            w.healthy, w.last_seen, w.refused = w.stats.healthy, time.monotonic(), False
        except (TimeoutError, aiohttp.ClientError, BackendError, OSError):
            w.healthy = False
            if rediscover:
                self._schedule_rediscover(w.worker_id)

    async def _pull_blocks(self, w: WorkerState) -> None:
        assert self._session is not None
        url = f"{w.info.url}/blocks?since={w.block_seq}"
        async with self._session.get(url, headers=w.auth, timeout=aiohttp.ClientTimeout(total=2)) as r:
            if r.status != 200:
                return
            batch = block_batch_decoder.decode(await r.read())
        if batch.reset:
            await self.block_index.drop_worker(w.worker_id)
        for ev in batch.events:
            await self.block_index.apply(w.worker_id, ev.kind, ev.hashes, ev.tier)
        w.block_seq = batch.seq

    def _schedule_rediscover(self, worker_id: str) -> None:
        if worker_id in self._rediscovering:
            return
        self._rediscovering.add(worker_id)

        async def run() -> None:
            try:
                for info in await self._discover(worker_id):
                    state = self.workers.setdefault(info.worker_id, WorkerState(info))
                    if info.url != state.info.url:  # a new process (Ray restarted it): the old one's failures
                        state.failures, state.open_until = 0, 0.0  # do not keep the new one out of routing
                    state.info = info
                    await self._poll(state, rediscover=False, heads=self.queue_heads())
            except Exception as e:  # the worker may still be restarting: the next poll tries again
                log.info("rediscovery of %s failed: %s", worker_id, e)
            finally:
                self._rediscovering.discard(worker_id)

        asyncio.get_running_loop().create_task(run())

    def record_failure(self, w: WorkerState) -> None:
        w.failures += 1
        if w.failures >= self._breaker_threshold:
            w.open_until = time.monotonic() + self._breaker_open_s
            log.warning("circuit open for worker %s after %d failures", w.worker_id, w.failures)
        self._schedule_rediscover(w.worker_id)

    async def open_stream(self, w: WorkerState, request: GenerateRequest) -> WorkerStream:
        """Send the request; returns the stream once the worker accepted it (its answer's head is in).

        Raises BackendError when the worker refuses or cannot be reached — nothing was sent to the
        client yet, so the caller may retry elsewhere.
        """
        try:
            resp = await self._channels.open(w.info.url, "/generate", encode(request), w.info.secret)
        except (TimeoutError, OSError, ValueError) as e:
            self.record_failure(w)
            raise BackendError(f"worker {w.worker_id} unreachable: {e}", 503, "worker_unreachable") from None
        if resp.status != 200:
            try:
                body = await resp.body()
            except (TimeoutError, OSError, ValueError):
                body = b""
            finally:
                resp.close()
            try:
                detail = msgspec_error(body)
            except Exception:
                detail = body[:200].decode(errors="replace")
            if resp.status >= 500 or resp.status == 401:
                self.record_failure(w)  # 401: our copy of its secret is stale (it restarted): look it up again
            status = 503 if resp.status == 401 or resp.status >= 600 else resp.status
            raise BackendError(detail, status, "worker_refused")
        w.failures = 0
        return resp


UPSTREAM_RCVBUF = 256 * 1024


def _bounded_socket(addr_info) -> socket.socket:
    """A socket to a worker with a fixed receive buffer: when a client stops reading, what piles up in the
    kernel for its stream stays bounded (loopback autotuning otherwise grows it to tens of MiB), and the
    worker's writes block, which pauses that generation."""
    family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UPSTREAM_RCVBUF)
    return sock


def iter_batches(resp: WorkerStream) -> AsyncIterator[list[Chunk]]:
    """Chunks from a worker stream (one JSON object per line), grouped by what arrived since the last
    batch, so the gateway can relay a burst of tokens in one write."""
    return resp.batches()


def msgspec_error(body: bytes) -> str:
    import msgspec

    data = msgspec.json.decode(body)
    return data.get("error", {}).get("message") or str(data)
