"""Admission priority belongs to the API key, and keys share the queue fairly: a real `pulse serve` with
keys (load-test backend: one slot, 0.2 s a request, the gateway's queue in front of it).

A flooding key's requests ask for priority 100 and get its own 0; a key allowed priority 5 sent after
the flood is served next; a third key with the flood's priority waits behind about one of the flood's
requests, not all of them.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from gateway.keys import FileKeyStore
from tests.conftest import PulseProcess

CONFIG = """
workers:
  backend: loadtest
  loadtest: {{tokens: 5, tokens_per_s: 25, slots: 1}}
admission: {{worker_queue_max: 0}}
keys: {{file: {keys}}}
server:
  drain_grace_s: 2
"""
FLOOD = 10


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fair")
    store = FileKeyStore(tmp / "keys.json")

    async def make():
        return {name: (await store.create(name, max_priority=prio))[0]
                for name, prio in (("flood", 0), ("other", 0), ("high", 5))}

    keys = asyncio.run(make())
    srv = PulseProcess([], CONFIG.format(keys=tmp / "keys.json"), tmp).wait_ready()
    yield srv, keys
    srv.stop()


async def test_priority_is_the_keys_and_a_flood_does_not_starve_another_key(keyed_server):
    srv, keys = keyed_server
    async with aiohttp.ClientSession() as http:
        async with http.get(srv.base + "/v1/models", headers={"Authorization": f"Bearer {keys['other']}"}) as r:
            model = (await r.json())["data"][0]["id"]
        done: dict[str, float] = {}

        async def one(name: str, key: str, **extra):
            body = {"model": model, "prompt": "hi", "max_tokens": 5, **extra}
            async with http.post(srv.base + "/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            done[name] = time.monotonic()

        flood = [asyncio.create_task(one(f"flood{i}", keys["flood"], priority=100)) for i in range(FLOOD)]
        await asyncio.sleep(0.3)  # the flood holds the slot and fills the queue
        late = [asyncio.create_task(one("high", keys["high"])), asyncio.create_task(one("other", keys["other"]))]
        await asyncio.gather(*flood, *late)
    order = sorted(done, key=done.get)
    # the flood's priority 100 was clamped to its key's 0: the key allowed 5 goes next, past the queue
    assert order.index("high") <= 2, order
    # the other key waits behind about one of the flood's requests (its turn), not behind the whole flood
    assert order.index("other") <= 4, order


async def test_a_keyed_gateway_needs_a_key_for_models_and_serves_any_name(keyed_server):
    """/v1/models needs a key once keys exist (as OpenAI's does); the open gateway's Host, Origin and
    Content-Type checks step aside: a key is what a web page cannot send."""
    srv, keys = keyed_server
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/models", "/v1/models/anything"):
            async with http.get(srv.base + path) as r:
                assert r.status == 401, path
        auth = {"Authorization": f"Bearer {keys['other']}"}
        async with http.get(srv.base + "/v1/models", headers=auth) as r:
            model = (await r.json())["data"][0]["id"]
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        headers = {**auth, "Host": "pulse.example.internal", "Origin": "https://app.example", "Content-Type": "text/plain"}
        async with http.post(srv.base + "/v1/completions", data=json.dumps(body), headers=headers) as r:
            assert r.status == 200, await r.text()
