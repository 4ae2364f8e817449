"""API keys and quotas against a real redis-server and a real keys file."""
from __future__ import annotations

import asyncio
import json
import stat

import pytest
import redis.asyncio as aioredis

from cache.redis_guard import make_client
from gateway.keys import FileKeyStore, KeysUnavailable, Limits, RedisKeyStore
from gateway.quota import LocalQuota, QuotaExceeded, RedisQuota
from policy.config import PulseConfig
from pulse.keys_cli import keys_main
from tests.conftest_redis import redis_server  # noqa: F401  (fixture)


@pytest.fixture(params=["file", "redis"])
async def store(request, tmp_path):
    if request.param == "file":
        yield FileKeyStore(tmp_path / "keys.json")
        return
    server = request.getfixturevalue("redis_server")
    s = RedisKeyStore(make_client(server.url, 0.5), namespace="t:", timeout_s=0.5)
    yield s
    await s.close()


async def test_create_verify_revoke(store):
    assert not await store.has_keys()
    plaintext, key = await store.create("ci", rpm=60, tpm=1000, concurrency=2, admin=True)
    assert plaintext.startswith(f"pk_{key.key_id}_")
    got = await store.verify(plaintext)
    assert got is not None and got.key_id == key.key_id and got.admin and got.limits == Limits(60, 1000, 2)
    assert await store.has_keys()
    forged = plaintext[:-1] + ("0" if plaintext[-1] != "0" else "1")  # right id, wrong secret
    for bad in (forged, "", "Bearer " + plaintext, plaintext + "x", "pk_zz_zz", "sk-whatever"):
        assert await store.verify(bad) is None, bad
    other, _ = await store.create("plain")
    assert not (await store.verify(other)).admin
    assert await store.revoke(key.key_id)
    assert not await store.revoke(key.key_id)  # already revoked
    assert not await store.revoke("000000000000")
    assert await store.verify(plaintext) is None
    listed = {k.key_id: k for k in await store.list()}
    assert set(listed) == {key.key_id, _.key_id} and not listed[key.key_id].active
    assert "digest" not in listed[key.key_id].public()
    assert plaintext not in repr(listed[key.key_id])


async def test_max_priority_is_stored_with_the_key(store):
    _, high = await store.create("batch-high", max_priority=5)
    plaintext, low = await store.create("bulk", max_priority=-1)
    default_key, _ = await store.create("plain")
    assert (await store.verify(plaintext)).max_priority == -1
    assert (await store.verify(default_key)).max_priority == 0
    assert {k.key_id: k.max_priority for k in await store.list()}[high.key_id] == 5


def test_cli_max_priority(tmp_path, capsys):
    cfg = PulseConfig.model_validate({"keys": {"file": str(tmp_path / "keys.json")}})
    assert keys_main(["create", "--max-priority", "3"], cfg) == 0
    plaintext = capsys.readouterr().out.strip()
    assert asyncio.run(FileKeyStore(tmp_path / "keys.json").verify(plaintext)).max_priority == 3
    assert keys_main(["list", "--json"], cfg) == 0
    assert json.loads(capsys.readouterr().out)["max_priority"] == 3


async def test_keys_file_is_private_hashed_and_shared(tmp_path):
    path = tmp_path / "cfg" / "keys.json"
    serving = FileKeyStore(path)
    assert await serving.verify("pk_0123456789ab_" + "0" * 48) is None
    assert not path.exists()  # reading never creates the file
    cli = FileKeyStore(path)  # another process: `pulse keys create` while `pulse serve` runs
    plaintext, key = await cli.create("x")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert plaintext not in text and plaintext.split("_")[2] not in text
    assert json.loads(text)["keys"][key.key_id]["digest"]
    assert (await serving.verify(plaintext)).key_id == key.key_id  # seen without a restart
    await cli.revoke(key.key_id)
    assert await serving.verify(plaintext) is None
    assert sorted(p.name for p in path.parent.iterdir()) == ["keys.json", "keys.json.lock"]  # no temp files left


async def test_redis_store_keeps_serving_known_keys_while_redis_is_away(redis_server):
    store = RedisKeyStore(make_client(redis_server.url, 0.05), namespace="t:", timeout_s=0.05,
                          retry_interval_s=0.1, stale_ttl_s=60)
    try:
        plaintext, key = await store.create("x")
        unknown = "pk_0123456789ab_" + "0" * 48
        assert (await store.verify(plaintext)).key_id == key.key_id
        raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        dump = json.dumps({k: await raw.hgetall(k) for k in await raw.keys("t:key:*")})
        await raw.aclose()
        assert plaintext not in dump
        redis_server.stop()
        assert (await store.verify(plaintext)).key_id == key.key_id  # last answer, within stale_ttl_s
        with pytest.raises(KeysUnavailable):
            await store.verify(unknown)  # never seen: 503, not a guess
    finally:
        await store.close()


async def test_a_slow_redis_answer_is_waited_for_not_a_503(redis_server):
    """`pulse serve`'s key store (redis.timeout_s at its 50 ms default, a routing hint's budget) still waits
    out a round trip of a few hundred ms: a busy box's first call after a restart is slow, not down."""
    cfg = PulseConfig.model_validate({"redis": {"url": redis_server.url}})
    assert cfg.redis.timeout_s <= 0.05
    store = RedisKeyStore.from_config(cfg)
    try:
        plaintext, key = await store.create("x")
        redis_server.pause()
        asyncio.get_running_loop().call_later(0.3, redis_server.resume)
        assert (await store.verify(plaintext)).key_id == key.key_id  # never seen by this store: no stale answer
        redis_server.pause()
        asyncio.get_running_loop().call_later(0.3, redis_server.resume)
        assert await store.has_keys()
    finally:
        redis_server.resume()
        await store.close()


# ---- quotas -------------------------------------------------------------------------------------


def two_quotas(server, **kw) -> tuple[RedisQuota, RedisQuota]:
    """Two gateways: separate clients, separate connection pools, one Redis."""
    return tuple(RedisQuota(make_client(server.url, 1.0), "t:", timeout_s=1.0, **kw) for _ in range(2))


async def gather_acquires(quotas, n: int, limits: Limits, tokens: int = 1):
    async def one(i):
        try:
            return await quotas[i % len(quotas)].acquire("k1", limits, tokens)
        except QuotaExceeded as e:
            return e

    return await asyncio.gather(*(one(i) for i in range(n)))


async def test_rpm_is_atomic_across_two_gateways(redis_server):
    a, b = two_quotas(redis_server)
    try:
        results = await gather_acquires([a, b], 40, Limits(rpm=10))
        granted = [r for r in results if not isinstance(r, QuotaExceeded)]
        refused = [r for r in results if isinstance(r, QuotaExceeded)]
        assert len(granted) == 10 and len(refused) == 30
        assert {r.limit for r in refused} == {"rpm"}
        assert all(1 <= r.retry_after_s <= 60 for r in refused)
        assert {g.local for g in granted} == {False}
        # another key has its own budget
        await a.acquire("k2", Limits(rpm=10), 1)
    finally:
        await a.close()
        await b.close()


async def test_concurrency_is_atomic_across_two_gateways_and_released(redis_server):
    a, b = two_quotas(redis_server)
    try:
        results = await gather_acquires([a, b], 12, Limits(concurrency=3))
        granted = [r for r in results if not isinstance(r, QuotaExceeded)]
        assert len(granted) == 3
        assert {r.limit for r in results if isinstance(r, QuotaExceeded)} == {"concurrency"}
        await b.release(granted[0])  # any gateway may release: leases live in Redis
        await a.acquire("k1", Limits(concurrency=3), 1)
        with pytest.raises(QuotaExceeded):
            await b.acquire("k1", Limits(concurrency=3), 1)
    finally:
        await a.close()
        await b.close()


async def test_tpm_charges_prompt_then_completion(redis_server):
    a, b = two_quotas(redis_server)
    try:
        g = await a.acquire("k1", Limits(tpm=100), 40)
        await a.release(g, extra_tokens=30)  # 70 used
        with pytest.raises(QuotaExceeded) as e:
            await b.acquire("k1", Limits(tpm=100), 40)
        assert e.value.limit == "tpm" and "100" in e.value.message
        await b.acquire("k1", Limits(tpm=100), 30)
        with pytest.raises(QuotaExceeded) as e:
            await a.acquire("k9", Limits(tpm=100), 101)
        assert e.value.limit == "tpm_request"
    finally:
        await a.close()
        await b.close()


@pytest.mark.slow
async def test_a_crashed_gateways_slots_lapse(redis_server):
    a, b = two_quotas(redis_server, lease_s=1.0)
    try:
        g = await a.acquire("k1", Limits(concurrency=1), 1)  # gateway a "crashes": never releases
        with pytest.raises(QuotaExceeded):
            await b.acquire("k1", Limits(concurrency=1), 1)
        await a.refresh(g)
        await asyncio.sleep(1.3)
        await b.acquire("k1", Limits(concurrency=1), 1)
    finally:
        await a.close()
        await b.close()


async def test_quota_falls_back_to_local_limits_when_redis_is_down(redis_server):
    q = RedisQuota(make_client(redis_server.url, 0.05), "t:", timeout_s=0.05, retry_interval_s=5)
    try:
        redis_server.stop()
        g = await q.acquire("k1", Limits(rpm=2, concurrency=5), 1)
        assert g.local
        await q.acquire("k1", Limits(rpm=2), 1)
        with pytest.raises(QuotaExceeded):
            await q.acquire("k1", Limits(rpm=2), 1)  # limits still hold, per gateway
        await q.release(g, 10)
    finally:
        await q.close()


async def test_local_quota_sliding_window():
    now = [600.0]  # the start of a minute
    q = LocalQuota(lease_s=30, clock=lambda: now[0])
    lim = Limits(rpm=10, concurrency=2)
    grants = []
    for _ in range(10):
        g = await q.acquire("k", Limits(rpm=10), 1)
        grants.append(g)
    with pytest.raises(QuotaExceeded) as e:
        await q.acquire("k", Limits(rpm=10), 1)
    assert e.value.retry_after_s == 60
    now[0] += 90  # half of last minute's 10 still count: 5 free
    for _ in range(5):
        await q.acquire("k", Limits(rpm=10), 1)
    with pytest.raises(QuotaExceeded):
        await q.acquire("k", Limits(rpm=10), 1)
    g1 = await q.acquire("c", lim, 1)
    await q.acquire("c", lim, 1)
    with pytest.raises(QuotaExceeded):
        await q.acquire("c", lim, 1)
    await q.release(g1)
    await q.acquire("c", lim, 1)
    now[0] += 31  # leases lapse
    await q.acquire("c", lim, 1)


# ---- the CLI ------------------------------------------------------------------------------------


def test_cli_create_list_revoke_on_the_keys_file(tmp_path, capsys):
    cfg = PulseConfig.model_validate({"keys": {"file": str(tmp_path / "keys.json")}})
    assert keys_main(["create", "--name", "ci", "--rpm", "5", "--concurrency", "2", "--admin"], cfg) == 0
    out, err = capsys.readouterr()
    plaintext = out.strip()
    key_id = plaintext.split("_")[1]
    assert out.count("\n") == 1 and key_id in err and "not shown again" in err
    assert keys_main(["list"], cfg) == 0
    out, _ = capsys.readouterr()
    assert key_id in out and "ci" in out and plaintext not in out
    assert asyncio.run(FileKeyStore(tmp_path / "keys.json").verify(plaintext)).rpm == 5
    assert keys_main(["revoke", key_id], cfg) == 0
    assert keys_main(["revoke", key_id], cfg) == 1
    capsys.readouterr()
    assert keys_main(["list", "--json", "--all"], cfg) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["key_id"] == key_id and row["revoked_at"] and "digest" not in row
    assert keys_main(["create", "--rpm", "-1"], cfg) == 2


def test_cli_acts_on_the_redis_store(redis_server, capsys):
    cfg = PulseConfig.model_validate({"redis": {"url": redis_server.url, "timeout_s": 0.5}})
    assert keys_main(["create", "--tpm", "1000"], cfg) == 0
    plaintext = capsys.readouterr().out.strip()

    async def check():
        s = RedisKeyStore.from_config(cfg)
        try:
            return await s.verify(plaintext)
        finally:
            await s.close()

    assert asyncio.run(check()).tpm == 1000
    redis_server.stop()
    cfg.redis.timeout_s = 0.05
    assert keys_main(["list"], cfg) == 2  # unreachable store: a clear message, exit 2
    assert "unreachable" in capsys.readouterr().err


def test_cli_loads_config_like_serve(tmp_path, capsys, monkeypatch):
    """Without a config passed in: --keys-file, --config and PULSE_* pick the store `pulse serve` reads."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert keys_main(["create", "--keys-file", str(a)]) == 0
    first = capsys.readouterr().out.strip()
    conf = tmp_path / "pulse.yaml"
    conf.write_text(f"keys: {{file: {b}, default_rpm: 7}}\n")
    assert keys_main(["create", "--config", str(conf)]) == 0
    second = capsys.readouterr().out.strip()
    assert asyncio.run(FileKeyStore(a).verify(first)) is not None
    assert asyncio.run(FileKeyStore(b).verify(second)).rpm == 7  # the config's default limits apply
    monkeypatch.setenv("PULSE_KEYS__FILE", str(a))
    assert keys_main(["list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["key_id"] == first.split("_")[1]
