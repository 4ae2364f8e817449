"""API keys: `Authorization: Bearer pk_<id>_<secret>`, stored only as salted HMAC-SHA256 digests.

    store = open_key_store(cfg)                      # Redis at cfg.redis.url, else the keys file
    key = await store.verify(bearer_token)           # ApiKey, or None (unknown, revoked, malformed)
    if key is None: -> 401;  if admin endpoint and not key.admin: -> 403
    quota.acquire(key.key_id, key.limits, tokens)    # gateway/quota.py
    plaintext, key = await store.create(name="ci", rpm=60, tpm=0, concurrency=4, admin=False, max_priority=0)
    await store.list(); await store.revoke(key_id); await store.has_keys(); await store.close()

`key_id` is public (it is in the key): use it in logs, traces and metric labels; never log the key.
Digest = HMAC-SHA256(per-store random salt, key), so a leaked store does not reveal keys and a digest
from one store is useless against another. FileKeyStore: JSON, mode 0600, atomic replace under a lock,
re-read when the file changes (so `pulse keys create` while `pulse serve` runs takes effect at once).
RedisKeyStore: shared by every gateway; while Redis is unreachable, keys verified within
`stale_ttl_s` still pass (the last answer is kept), others raise KeysUnavailable (answer 503).
"""
from __future__ import annotations

import abc
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from cache.redis_guard import ANSWER_TIMEOUT_S, RedisGuard, make_client

KEY_RE = re.compile(r"^pk_([0-9a-f]{12})_([0-9a-f]{48})$")
DEFAULT_KEYS_FILE = "~/.config/pulse/keys.json"


class KeysUnavailable(Exception):
    """The key store could not be read (Redis down, nothing cached): answer 503, not 401."""


@dataclass(frozen=True)
class Limits:
    rpm: int = 0  # requests per minute; 0: unlimited
    tpm: int = 0  # tokens per minute (prompt + completion); 0: unlimited
    concurrency: int = 0  # requests in flight at once; 0: unlimited


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    digest: str = field(repr=False)  # never shown by list or repr
    name: str = ""
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0
    admin: bool = False
    created_at: float = 0.0
    revoked_at: float | None = None
    max_priority: int = 0  # the priority its requests run at; a request may ask for less, never more

    @property
    def limits(self) -> Limits:
        return Limits(self.rpm, self.tpm, self.concurrency)

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def public(self) -> dict:
        """Everything but the digest (for `pulse keys list` and admin endpoints)."""
        d = asdict(self)
        d.pop("digest")
        return d


def new_key() -> tuple[str, str]:
    """(key_id, plaintext key)."""
    key_id = secrets.token_hex(6)
    return key_id, f"pk_{key_id}_{secrets.token_hex(24)}"


def digest(salt: str, key: str) -> str:
    return hmac.new(bytes.fromhex(salt), key.encode(), hashlib.sha256).hexdigest()


def parse_key(presented: str) -> str | None:
    """The key_id of a well-formed key, else None (nothing about the key is logged)."""
    m = KEY_RE.match(presented or "")
    return m.group(1) if m else None


class KeyStore(abc.ABC):
    """Where keys live. Every method is a coroutine; see the module docstring."""

    async def create(
        self, name: str = "", rpm: int = 0, tpm: int = 0, concurrency: int = 0, admin: bool = False,
        max_priority: int = 0,
    ) -> tuple[str, ApiKey]:
        """A new key: returns (plaintext, record). The plaintext is not stored and cannot be shown again."""
        if min(rpm, tpm, concurrency) < 0:
            raise ValueError("limits must be >= 0 (0: unlimited)")
        key_id, plaintext = new_key()
        salt = await self._salt()
        record = ApiKey(key_id, digest(salt, plaintext), name, rpm, tpm, concurrency, admin, time.time(),
                        max_priority=max_priority)
        await self._put(record)
        return plaintext, record

    async def verify(self, presented: str) -> ApiKey | None:
        key_id = parse_key(presented)
        if key_id is None:
            return None
        record = await self._get(key_id)
        if record is None or not record.active:
            return None
        salt = await self._salt()
        return record if hmac.compare_digest(record.digest, digest(salt, presented)) else None

    async def revoke(self, key_id: str) -> bool:
        """True if an active key was revoked."""
        record = await self._get(key_id)
        if record is None or not record.active:
            return False
        await self._put(replace(record, revoked_at=time.time()))
        return True

    async def has_keys(self) -> bool:
        return any(k.active for k in await self.list())

    @abc.abstractmethod
    async def list(self) -> list[ApiKey]: ...

    @abc.abstractmethod
    async def _salt(self) -> str: ...

    @abc.abstractmethod
    async def _get(self, key_id: str) -> ApiKey | None: ...

    @abc.abstractmethod
    async def _put(self, record: ApiKey) -> None: ...

    async def close(self) -> None:
        return None


class FileKeyStore(KeyStore):
    """The single-box store: one JSON file, mode 0600."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self._stamp: tuple[int, int] | None = None  # (mtime_ns, size) of what _data holds
        self._data: dict = {}

    async def list(self) -> list[ApiKey]:
        return sorted((ApiKey(**v) for v in self._load()["keys"].values()), key=lambda k: k.created_at)

    async def _salt(self) -> str:
        data = self._load()
        if not data.get("salt"):
            data = self._update(lambda d: d)  # writing creates the salt
        return data["salt"]

    async def _get(self, key_id: str) -> ApiKey | None:
        v = self._load()["keys"].get(key_id)
        return ApiKey(**v) if v else None

    async def _put(self, record: ApiKey) -> None:
        def put(d: dict) -> dict:
            d["keys"][record.key_id] = asdict(record)
            return d

        self._update(put)

    def _load(self) -> dict:
        """The file's contents, re-read only when it changed (one stat per call)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._stamp, self._data = None, {"version": 1, "salt": "", "keys": {}}
            return self._data
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._data = json.loads(self.path.read_text())
            self._stamp = stamp
        return self._data

    def _update(self, change) -> dict:
        """Read-modify-write under an exclusive lock, replacing the file atomically (0600)."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        with open(os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o600)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._stamp = None  # re-read inside the lock: another process may have written
            data = change(self._load())
            data.setdefault("salt", "")
            if not data["salt"]:
                data["salt"] = secrets.token_hex(32)
            self._write(data)
            self._stamp = None
            return self._load()

    def _write(self, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".keys-", suffix=".tmp")  # mkstemp: 0600
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)


class RedisKeyStore(KeyStore):
    """Keys shared by every gateway: NS keys:salt, NS key:<id> (hash), NS keys:ids and NS keys:active (sets)."""

    def __init__(self, client, namespace: str = "pulse:", timeout_s: float = 0.05, retry_interval_s: float = 1.0,
                 stale_ttl_s: float = 300.0, bulk_timeout_s: float = 5.0):
        self._r = client
        self.ns = namespace
        self.stale_ttl_s = stale_ttl_s
        self.bulk_timeout_s = bulk_timeout_s  # list and create are admin/CLI paths, not per request
        self.guard = RedisGuard(timeout_s, retry_interval_s, KeysUnavailable)
        self._salt_value: str | None = None
        self._seen: dict[str, tuple[ApiKey | None, float]] = {}  # key_id -> (last answer, when)

    @classmethod
    def from_config(cls, cfg) -> RedisKeyStore:
        """From a PulseConfig whose redis.url is set. A key check that times out is a 503 to the caller, not a
        routing hint: it waits at least ANSWER_TIMEOUT_S, whatever redis.timeout_s says."""
        r = cfg.redis
        timeout_s = max(r.timeout_s, ANSWER_TIMEOUT_S)
        return cls(make_client(r.url, timeout_s), r.namespace, timeout_s, r.retry_interval_s, cfg.keys.stale_ttl_s)

    async def list(self) -> list[ApiKey]:
        async def read():
            ids = await self._r.smembers(self.ns + "keys:ids")
            async with self._r.pipeline(transaction=False) as p:
                for key_id in ids:
                    p.hgetall(self.ns + "key:" + key_id)
                return [v for v in await p.execute() if v]

        rows = await self.guard.run(read, "keys list", self.bulk_timeout_s)
        return sorted((_from_hash(v) for v in rows), key=lambda k: k.created_at)

    async def has_keys(self) -> bool:
        """One SCARD, so gateways can re-check it often."""
        return await self.guard.run(lambda: self._r.scard(self.ns + "keys:active"), "keys count") > 0

    async def _salt(self) -> str:
        if self._salt_value is None:
            async def read_or_make():
                await self._r.set(self.ns + "keys:salt", secrets.token_hex(32), nx=True)
                return await self._r.get(self.ns + "keys:salt")

            self._salt_value = await self.guard.run(read_or_make, "keys salt")
        return self._salt_value

    async def _get(self, key_id: str) -> ApiKey | None:
        try:
            v = await self.guard.run(lambda: self._r.hgetall(self.ns + "key:" + key_id), "key get")
        except KeysUnavailable:
            seen = self._seen.get(key_id)
            if seen is not None and time.monotonic() - seen[1] <= self.stale_ttl_s:
                return seen[0]  # Redis is away: keep honouring the last answer for a while
            raise
        record = _from_hash(v) if v else None
        if record is None:
            self._seen.pop(key_id, None)  # only real keys are remembered: made-up ids cannot grow this
        else:
            self._seen[key_id] = (record, time.monotonic())
        return record

    async def _put(self, record: ApiKey) -> None:
        fields = {k: json.dumps(v) for k, v in asdict(record).items()}

        async def write():
            async with self._r.pipeline(transaction=True) as p:
                p.hset(self.ns + "key:" + record.key_id, mapping=fields)
                p.sadd(self.ns + "keys:ids", record.key_id)
                if record.active:
                    p.sadd(self.ns + "keys:active", record.key_id)
                else:
                    p.srem(self.ns + "keys:active", record.key_id)
                await p.execute()

        await self.guard.run(write, "key put", self.bulk_timeout_s)
        self._seen.pop(record.key_id, None)

    async def close(self) -> None:
        await self._r.aclose()


def _from_hash(v: dict) -> ApiKey:
    return ApiKey(**{k: json.loads(x) for k, x in v.items()})


def open_key_store(cfg) -> KeyStore:
    """The store `pulse serve` and `pulse keys` share: Redis at cfg.redis.url, else the keys file."""
    if cfg.redis.url:
        return RedisKeyStore.from_config(cfg)
    return FileKeyStore(cfg.keys.file or DEFAULT_KEYS_FILE)
