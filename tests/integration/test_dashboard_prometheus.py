"""A real Prometheus scrapes a real /metrics served from GatewayMetrics, and every dashboard query answers.

Needs the `prometheus` binary (Debian's package; `deploy/install.sh --test` installs it): skipped where it
is absent on a developer's box, a failure under CI.
"""
from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import subprocess
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.metrics import GatewayMetrics
from tests.required import absent
from tests.unit.test_metrics import full_snapshots
from workers.protocol import Usage

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.slow]


@pytest.fixture(autouse=True)
def _prometheus_present():
    if PROMETHEUS is None:
        absent("the prometheus binary is not installed (deploy/install.sh --test installs it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((ROOT / "deploy/grafana/dashboards/pulse.json").read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"].replace("$__rate_interval", "10s").replace("$model", ".*").replace("$worker", ".*")
            out.append((p["title"], expr))
    return out


async def serve_metrics(m: GatewayMetrics, port: int) -> web.AppRunner:
    async def metrics(_request):
        body, ctype = m.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def traffic(m: GatewayMetrics, snaps: dict, i: int) -> None:
    r = m.request("gemma-3-270m")
    for _ in range(4):
        r.chunk(1)
    r.finish(200 if i % 5 else 503, Usage(prompt_tokens=64, completion_tokens=4, cached_tokens=48,
                                          drafted_tokens=6, accepted_tokens=4))
    m.rejected("quota")
    m.routed(5e-5)
    m.prefix_lookup(2e-4, 48, 64)
    w0 = snaps["w0"]
    w0.generated_tokens += 4
    w0.preemptions += 1
    w0.steps_by_k = [n + 1 for n in w0.steps_by_k]
    w0.drafted_by_position = [n + 3 for n in w0.drafted_by_position]
    w0.accepted_by_position = [n + 2 for n in w0.accepted_by_position]


async def scrapes_seen(http: aiohttp.ClientSession) -> int:
    try:
        async with http.get("/api/v1/query", params={"query": "count_over_time(pulse_queue_depth[1m])"}) as resp:
            result = (await resp.json())["data"]["result"]
    except aiohttp.ClientError:  # Prometheus still starting
        return 0
    return int(float(result[0]["value"][1])) if result else 0


async def traffic_until_scraped(http: aiohttp.ClientSession, m: GatewayMetrics, snaps: dict, scrapes: int) -> None:
    """Send traffic until Prometheus has scraped `scrapes` times, so rate() has points to work with."""
    for i in range(600):
        traffic(m, snaps, i)
        await asyncio.sleep(0.1)
        if i % 5 == 0 and await scrapes_seen(http) >= scrapes:
            return
    raise AssertionError("Prometheus did not scrape /metrics within 60 s")


async def test_every_dashboard_query_returns_data(tmp_path):
    snaps = full_snapshots()
    m = GatewayMetrics(worker_snapshots=snaps)
    app_port, prom_port = free_port(), free_port()
    config = {"global": {"scrape_interval": "1s"},
              "scrape_configs": [{"job_name": "pulse", "static_configs": [{"targets": [f"127.0.0.1:{app_port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    runner = await serve_metrics(m, app_port)
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{prom_port}") as http:
            await traffic_until_scraped(http, m, snaps, scrapes=4)
            empty, nan_only = [], []
            for title, expr in dashboard_queries():
                async with http.get("/api/v1/query", params={"query": expr}) as resp:
                    body = await resp.json()
                assert body["status"] == "success", (title, expr, body)
                values = [float(r["value"][1]) for r in body["data"]["result"]]
                if not values:
                    empty.append((title, expr))
                elif all(math.isnan(v) for v in values):
                    nan_only.append((title, expr))
        assert not empty, f"queries with no data: {empty}"
        assert not nan_only, f"queries with only NaN: {nan_only}"
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        await runner.cleanup()
