"""Per-key limits: requests/minute, tokens/minute and requests in flight, checked and charged atomically.

    quota = open_quota(cfg)                       # RedisQuota at cfg.redis.url, else LocalQuota
    try:
        grant = await quota.acquire(key.key_id, key.limits, prompt_tokens)
    except QuotaExceeded as e:                    # -> 429, Retry-After: e.retry_after_s, code e.code
        ...
    try: ... stream ...
    finally:
        await quota.release(grant, completion_tokens)   # frees the concurrency slot, charges output tokens
    await quota.refresh(grant)                    # for streams longer than keys.concurrency_lease_s
    await quota.close()

Minutes are sliding-window counters (this minute's count plus last minute's, weighted by how much of
it is still inside the window): O(1) state per key, accurate to a few percent. Prompt tokens are
charged at acquire, completion tokens at release, so TPM can overshoot by one request's output.
Concurrency slots are leases with an expiry (`lease_s`), so a gateway that crashes mid-request
cannot hold a key's slots forever.

RedisQuota runs one Lua script per acquire (check all three limits, then charge all, or none), so
limits hold across every gateway replica. When Redis is unreachable it falls back to a LocalQuota
(limits then hold per gateway) instead of failing requests.
"""
from __future__ import annotations

import abc
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from cache.redis_guard import RedisGuard, RedisUnavailable, make_client
from gateway.keys import Limits

log = logging.getLogger(__name__)
WINDOW_S = 60


class QuotaExceeded(Exception):
    def __init__(self, limit: str, retry_after_s: int, message: str):
        super().__init__(message)
        self.limit, self.retry_after_s, self.message = limit, retry_after_s, message
        self.code = "rate_limit_exceeded"


@dataclass(frozen=True)
class Grant:
    key_id: str
    lease: str
    tokens: int
    local: bool = False  # granted by the in-process fallback (release it there)


def _exceeded(limit: str, retry: int, limits: Limits, tokens: int) -> QuotaExceeded:
    messages = {
        "concurrency": f"Too many requests in flight for this key (limit {limits.concurrency})",
        "rpm": f"Requests-per-minute limit of this key reached ({limits.rpm}/min)",
        "tpm": f"Tokens-per-minute limit of this key reached ({limits.tpm}/min)",
        "tpm_request": f"This request's {tokens} prompt tokens exceed the key's limit of {limits.tpm} tokens/min",
    }
    return QuotaExceeded(limit, retry, f"{messages[limit]}; retry after {retry} s.")


def _retry_after(prev: float, estimate: float, cost: float, limit: float, elapsed: float) -> int:
    """Seconds until the sliding estimate leaves room for `cost`: last minute's share decays linearly."""
    over = estimate + cost - limit
    if prev > 0:
        wait = WINDOW_S * over / prev
        if wait <= WINDOW_S - elapsed:
            return max(1, math.ceil(wait))
    return max(1, math.ceil(WINDOW_S - elapsed))


class Quota(abc.ABC):
    @abc.abstractmethod
    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Grant: ...

    @abc.abstractmethod
    async def release(self, grant: Grant, extra_tokens: int = 0) -> None: ...

    @abc.abstractmethod
    async def refresh(self, grant: Grant) -> None: ...

    async def close(self) -> None:
        return None


class LocalQuota(Quota):
    """In-process limits (the single box; also RedisQuota's fallback). Atomic: no await inside."""

    def __init__(self, lease_s: float = 900.0, clock: Callable[[], float] = time.time):
        self.lease_s = lease_s
        self._clock = clock
        self._counts: dict[tuple[str, str, int], float] = {}  # (key, "r"|"t", window) -> count
        self._leases: dict[str, dict[str, float]] = {}  # key -> lease -> expires

    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Grant:
        now = self._clock()
        win, elapsed = divmod(now, WINDOW_S)
        win = int(win)
        leases = self._leases.setdefault(key_id, {})
        for lease in [k for k, exp in leases.items() if exp <= now]:
            del leases[lease]
        if limits.concurrency and len(leases) >= limits.concurrency:
            raise _exceeded("concurrency", 1, limits, tokens)
        checks = (("r", limits.rpm, 1, "rpm"), ("t", limits.tpm, tokens, "tpm"))
        for kind, limit, cost, name in checks:
            if not limit:
                continue
            if name == "tpm" and cost > limit:
                raise _exceeded("tpm_request", WINDOW_S, limits, tokens)
            prev, cur = self._counts.get((key_id, kind, win - 1), 0), self._counts.get((key_id, kind, win), 0)
            estimate = prev * (WINDOW_S - elapsed) / WINDOW_S + cur
            if estimate + cost > limit:
                raise _exceeded(name, _retry_after(prev, estimate, cost, limit, elapsed), limits, tokens)
        self._charge(key_id, "r", win, 1)
        self._charge(key_id, "t", win, tokens)
        lease = secrets.token_hex(8)
        if limits.concurrency:
            leases[lease] = now + self.lease_s
        return Grant(key_id, lease, tokens, local=True)

    async def release(self, grant: Grant, extra_tokens: int = 0) -> None:
        self._leases.get(grant.key_id, {}).pop(grant.lease, None)
        if extra_tokens:
            self._charge(grant.key_id, "t", int(self._clock() // WINDOW_S), extra_tokens)

    async def refresh(self, grant: Grant) -> None:
        leases = self._leases.get(grant.key_id, {})
        if grant.lease in leases:
            leases[grant.lease] = self._clock() + self.lease_s

    def _charge(self, key_id: str, kind: str, win: int, n: float) -> None:
        k = (key_id, kind, win)
        if k not in self._counts:
            # Windows older than the previous one no longer matter: drop them as new ones open.
            for old in [o for o in self._counts if o[0] == key_id and o[1] == kind and o[2] < win - 1]:
                del self._counts[old]
        self._counts[k] = self._counts.get(k, 0) + n


# ARGV: ns, key_id, rpm, tpm, concurrency, tokens, lease, lease_s. Returns {ok, limit, retry_after_s}.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ns, id = ARGV[1], ARGV[2]
local rpm, tpm, conc, tokens = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local lease, lease_s = ARGV[7], tonumber(ARGV[8])
local win = math.floor(now / 60)
local elapsed = now - win * 60
local base = ns .. 'q:' .. id .. ':'
local ckey = base .. 'c'
local function retry(prev, est, cost, limit)
  local over = est + cost - limit
  if prev > 0 then
    local wait = 60 * over / prev
    if wait <= 60 - elapsed then return math.max(1, math.ceil(wait)) end
  end
  return math.max(1, math.ceil(60 - elapsed))
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', ckey, '-inf', now)
  if redis.call('ZCARD', ckey) >= conc then return {0, 'concurrency', 1} end
end
local checks = {{'r', rpm, 1, 'rpm'}, {'t', tpm, tokens, 'tpm'}}
for _, c in ipairs(checks) do
  local kind, limit, cost, name = c[1], c[2], c[3], c[4]
  if limit > 0 then
    if name == 'tpm' and cost > limit then return {0, 'tpm_request', 60} end
    local prev = tonumber(redis.call('GET', base .. kind .. ':' .. (win - 1)) or '0')
    local cur = tonumber(redis.call('GET', base .. kind .. ':' .. win) or '0')
    local est = prev * (60 - elapsed) / 60 + cur
    if est + cost > limit then return {0, name, retry(prev, est, cost, limit)} end
  end
end
redis.call('INCRBY', base .. 'r:' .. win, 1)
redis.call('EXPIRE', base .. 'r:' .. win, 150)
redis.call('INCRBY', base .. 't:' .. win, tokens)
redis.call('EXPIRE', base .. 't:' .. win, 150)
if conc > 0 then
  redis.call('ZADD', ckey, now + lease_s, lease)
  redis.call('EXPIRE', ckey, math.ceil(lease_s) + 1)
end
return {1, '', 0}
"""

# ARGV: ns, key_id, lease, extra_tokens, lease_s (0: release; > 0: refresh the lease for that long)
_RELEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local base = ARGV[1] .. 'q:' .. ARGV[2] .. ':'
local extra, lease_s = tonumber(ARGV[4]), tonumber(ARGV[5])
if lease_s > 0 then
  redis.call('ZADD', base .. 'c', 'XX', now + lease_s, ARGV[3])
  redis.call('EXPIRE', base .. 'c', math.ceil(lease_s) + 1)
  return 1
end
redis.call('ZREM', base .. 'c', ARGV[3])
if extra > 0 then
  local win = math.floor(now / 60)
  redis.call('INCRBY', base .. 't:' .. win, extra)
  redis.call('EXPIRE', base .. 't:' .. win, 150)
end
return 1
"""


class RedisQuota(Quota):
    def __init__(self, client, namespace: str = "pulse:", timeout_s: float = 0.05, retry_interval_s: float = 1.0,
                 lease_s: float = 900.0, fallback: LocalQuota | None = None):
        self._r = client
        self.ns = namespace
        self.lease_s = lease_s
        self.guard = RedisGuard(timeout_s, retry_interval_s, RedisUnavailable)
        self.fallback = fallback or LocalQuota(lease_s)
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_config(cls, cfg) -> RedisQuota:
        r = cfg.redis
        return cls(make_client(r.url, r.timeout_s), r.namespace, r.timeout_s, r.retry_interval_s,
                   cfg.keys.concurrency_lease_s)

    async def acquire(self, key_id: str, limits: Limits, tokens: int) -> Grant:
        lease = secrets.token_hex(8)
        args = [self.ns, key_id, limits.rpm, limits.tpm, limits.concurrency, tokens, lease, self.lease_s]
        try:
            ok, limit, retry = await self.guard.run(lambda: self._acquire(args=args), "quota acquire")
        except RedisUnavailable:
            # Serving beats refusing: hold limits per gateway until Redis answers again.
            return await self.fallback.acquire(key_id, limits, tokens)
        if not ok:
            raise _exceeded(limit, int(retry), limits, tokens)
        return Grant(key_id, lease, tokens)

    async def release(self, grant: Grant, extra_tokens: int = 0) -> None:
        await self._release_or_refresh(grant, extra_tokens, 0)

    async def refresh(self, grant: Grant) -> None:
        await self._release_or_refresh(grant, 0, self.lease_s)

    async def _release_or_refresh(self, grant: Grant, extra_tokens: int, lease_s: float) -> None:
        if grant.local:
            await (self.fallback.refresh(grant) if lease_s else self.fallback.release(grant, extra_tokens))
            return
        args = [self.ns, grant.key_id, grant.lease, extra_tokens, lease_s]
        try:
            await self.guard.run(lambda: self._release(args=args), "quota release")
        except RedisUnavailable:
            log.warning("quota release for key %s not recorded (redis away); its lease lapses in %.0f s",
                        grant.key_id, self.lease_s)

    async def close(self) -> None:
        await self._r.aclose()


def open_quota(cfg) -> Quota:
    """RedisQuota when cfg.redis.url is set (shared by every gateway), else LocalQuota."""
    if cfg.redis.url:
        return RedisQuota.from_config(cfg)
    return LocalQuota(cfg.keys.concurrency_lease_s)
