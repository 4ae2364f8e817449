"""gateway.auth: keys file + in-process quota (single box) and Redis store (many gateways), real parts."""
from __future__ import annotations

import asyncio

import pytest

from cache.redis_guard import make_client
from gateway.auth import KeyAuth
from gateway.errors import APIError
from gateway.keys import FileKeyStore, RedisKeyStore
from gateway.quota import LocalQuota
from tests.conftest_redis import redis_server  # noqa: F401  (fixture)


async def status_of(coro) -> int:
    try:
        await coro
    except APIError as e:
        return e.status
    return 200


async def test_open_on_loopback_until_a_key_exists(tmp_path):
    store = FileKeyStore(tmp_path / "keys.json")
    auth = KeyAuth(store, LocalQuota(), host="127.0.0.1", recheck_s=0.05)
    assert "open without auth" in await auth.start()
    assert await auth.authenticate(None) is None
    assert await auth.authenticate(None, admin=True) is None
    # every OpenAI client sends a bearer token (the README's example sends "unused"): open means open
    assert await auth.authenticate("Bearer unused") is None
    assert await auth.authenticate("Bearer unused", admin=True) is None
    plaintext, key = await FileKeyStore(tmp_path / "keys.json").create("ci", rpm=1, admin=False)
    await asyncio.sleep(0.06)
    assert await status_of(auth.authenticate(None)) == 401  # a key now exists: auth is on
    assert await status_of(auth.authenticate("Bearer unused")) == 401
    assert (await auth.authenticate(f"Bearer {plaintext}")).key_id == key.key_id
    assert await status_of(auth.authenticate(f"Bearer {plaintext}x")) == 401
    assert await status_of(auth.authenticate(f"Basic {plaintext}")) == 401
    assert await status_of(auth.authenticate(f"Bearer {plaintext}", admin=True)) == 403
    grant = await auth.acquire(key, 10)
    with pytest.raises(APIError) as e:
        await auth.acquire(key, 10)  # rpm 1
    assert e.value.status == 429 and int(e.value.headers["Retry-After"]) >= 1
    assert plaintext not in e.value.message
    await auth.release(grant, 5)
    await auth.close()


async def test_no_keys_on_a_public_bind_refuses(tmp_path):
    auth = KeyAuth(FileKeyStore(tmp_path / "keys.json"), LocalQuota(), host="0.0.0.0")
    assert "refused" in await auth.start()
    assert await status_of(auth.authenticate(None)) == 401
    assert await status_of(auth.authenticate("Bearer unused")) == 401


async def test_store_unreachable_is_503_not_401(redis_server):
    store = RedisKeyStore(make_client(redis_server.url, 0.2), "t:", timeout_s=0.2, retry_interval_s=5)
    auth = KeyAuth(store, LocalQuota(), host="127.0.0.1")
    await store.create("x")
    redis_server.stop()
    assert await status_of(auth.authenticate(None)) == 401  # fail closed: keys existed
    assert await status_of(auth.authenticate("Bearer pk_0123456789ab_" + "0" * 48)) == 503
    await auth.close()
