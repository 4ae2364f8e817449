"""Request authentication and per-key quota, as the gateway's handlers call them.

    auth = KeyAuth(open_key_store(cfg), open_quota(cfg), host=cfg.server.host,
                   open_when_empty=cfg.keys.open_when_empty)
    log.info(await auth.start())                      # says whether the gateway is open or keyed
    key = await auth.authenticate(request.headers.get("Authorization"), admin=False)   # ApiKey | None (open)
    grant = await auth.acquire(key, prompt_tokens)    # Grant | None; raises APIError 429 with Retry-After
    priority, tenant = auth.placement(key, asked)      # the admission priority (the key's, or less) and tenant
    ... finally: await auth.release(grant, completion_tokens)
    await auth.close()

Errors are gateway.errors.APIError: 401 (missing/unknown/revoked key), 403 (admin scope needed),
429 (key over its rpm/tpm/concurrency, with Retry-After), 503 (key store unreachable and the key not
seen recently). With no active key in the store, requests pass (with any bearer token or none) only when
`open_when_empty` and the bind address is loopback; a key created while serving switches auth on within
`recheck_s`.
Key ids (public) may go to logs and spans; the key itself never does.
"""
from __future__ import annotations

import ipaddress
import time

from gateway.errors import APIError
from gateway.keys import ApiKey, KeyStore, KeysUnavailable
from gateway.quota import Grant, Quota, QuotaExceeded
from policy.admission import effective_priority


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KeyAuth:
    def __init__(self, store: KeyStore, quota: Quota, *, host: str, open_when_empty: bool = True,
                 recheck_s: float = 2.0):
        self.store, self.quota = store, quota
        self.host = host
        self.open_when_empty = open_when_empty
        self._may_open = open_when_empty and is_loopback(host)  # fixed at start; is_open asks it per request
        self.recheck_s = recheck_s
        self._has_keys: bool | None = None
        self._checked_at = 0.0

    async def start(self) -> str:
        """One line for the start-up log: keyed, or open (and why)."""
        keyed = await self._keyed()
        if keyed:
            return "API keys required (Authorization: Bearer ...)"
        if self.open_when_empty and is_loopback(self.host):
            return f"no API keys configured: open without auth, on loopback ({self.host}) only"
        return f"no API keys configured and {self.host} is not loopback: every request is refused (401) " \
               "until `pulse keys create` makes one"

    async def is_open(self) -> bool:
        """Whether requests pass without a key now: no active key, open_when_empty, a loopback bind."""
        return self._may_open and not await self._keyed()

    async def authenticate(self, authorization: str | None, *, admin: bool = False) -> ApiKey | None:
        """The caller's key, or None when the gateway is open (no keys, loopback). Raises APIError."""
        token = _bearer(authorization)
        if await self.is_open():
            # The single-box default: open (admin endpoints too), reachable from this machine only. Any
            # bearer token passes, since every OpenAI client sends one (`api_key="unused"`) and most refuse
            # to start without it; once a key exists, tokens are checked.
            return None
        if token is None:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        try:
            key = await self.store.verify(token)
        except KeysUnavailable:
            raise APIError(503, "The key store is unreachable; retry shortly.", code="auth_unavailable",
                           headers={"Retry-After": "1"}) from None
        if key is None:
            raise APIError(401, "Invalid or revoked API key.", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if admin and not key.admin:
            raise APIError(403, "This endpoint needs an admin key.", code="insufficient_scope")
        return key

    async def acquire(self, key: ApiKey | None, prompt_tokens: int) -> Grant | None:
        if key is None:
            return None
        try:
            return await self.quota.acquire(key.key_id, key.limits, prompt_tokens)
        except QuotaExceeded as e:
            raise APIError(429, e.message, code=e.code, headers={"Retry-After": str(e.retry_after_s)}) from None

    @staticmethod
    def placement(key: ApiKey | None, asked: int | None) -> tuple[int, str]:
        """(priority, tenant) for the admission queue: the key's max_priority, lowered when the request asks
        for less; the key's id as the tenant fair queueing shares turns between. Open mode: at most 0, one tenant."""
        if key is None:
            return effective_priority(asked, 0), ""
        return effective_priority(asked, key.max_priority), key.key_id

    async def release(self, grant: Grant | None, completion_tokens: int = 0) -> None:
        if grant is not None:
            await self.quota.release(grant, completion_tokens)

    async def close(self) -> None:
        await self.store.close()
        await self.quota.close()

    async def _keyed(self) -> bool:
        """Whether any active key exists (re-read every recheck_s).

        On a store error the last known answer stands (a keyless loopback box stays open through a Redis
        restart); with no answer yet, assume keyed: never open up because Redis is away."""
        now = time.monotonic()
        if self._has_keys is None or now - self._checked_at >= self.recheck_s:
            try:
                self._has_keys = await self.store.has_keys()
            except KeysUnavailable:
                self._has_keys = True if self._has_keys is None else self._has_keys
            self._checked_at = now
        return self._has_keys


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
