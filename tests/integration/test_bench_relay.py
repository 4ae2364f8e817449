"""The bench upstream, the plain relay and the load generator, end to end on loopback (real processes)."""
import json
import os
import time
import urllib.error
import urllib.request

import pytest

from bench import gateway_overhead
from bench.loadgen import LoadSpec, run_load
from bench.procs import Proc, Served, descendants, python_module

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    procs: list = []
    try:
        up = Served(procs, "upstream", lambda port: python_module("bench.relay", "upstream", "--port", str(port),
                                                                  "--tokens", "12"), logs)
        direct = up.ready(20)
        relay = Served(procs, "relay", lambda port: python_module("bench.relay", "relay", "--port", str(port),
                                                                  "--upstream", direct), logs)
        yield {"direct": direct, "relay": relay.ready(20)}
    finally:
        for proc in reversed(procs):
            proc.stop()
    for proc in procs:
        assert proc.popen.poll() is not None, f"{proc.name} still running"


@pytest.mark.parametrize("target", ["direct", "relay"])
@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_streaming_load_counts_every_token(servers, target, api):
    out = await run_load(LoadSpec(url=servers[target], api=api, clients=4, requests=40, duration=10, max_tokens=64))
    m = out["metrics"]
    assert (m["requests"], m["ok"], m["errors"], m["rate_limited"]) == (40, 40, 0, 0)
    assert m["tok_s"] == pytest.approx(12 * m["req_s"])  # 12 tokens each, read from the usage event
    assert 0 < m["ttft_p50_ms"] <= m["ttft_p99_ms"] <= m["total_p99_ms"]
    assert m["itl_p50_ms"] is not None


async def test_max_tokens_caps_the_stream_and_non_streaming_works(servers):
    out = await run_load(LoadSpec(url=servers["relay"], clients=1, requests=5, max_tokens=3))
    assert out["metrics"]["tok_s"] == pytest.approx(3 * out["metrics"]["req_s"])
    out = await run_load(LoadSpec(url=servers["relay"], clients=2, requests=6, stream=False))
    assert out["metrics"]["ok"] == 6 and out["metrics"]["ttft_p50_ms"] > 0


async def test_time_bound_and_open_loop_rate(servers):
    out = await run_load(LoadSpec(url=servers["direct"], clients=2, duration=0.5))
    assert 0.4 < out["metrics"]["wall_s"] < 3 and out["metrics"]["ok"] > 0
    out = await run_load(LoadSpec(url=servers["direct"], rate=20, clients=8, duration=1.0))
    assert 15 <= out["metrics"]["requests"] <= 21  # 20/s for 1 s, issued by the clock


async def test_errors_are_counted_by_status_through_the_relay(servers):
    # a path the upstream lacks: its 404 comes back through the relay and is counted as an error
    out = await run_load(LoadSpec(url=servers["relay"] + "/nowhere", clients=1, requests=3))
    assert out["metrics"]["errors"] == 3 and out["status_counts"] == {"404": 3}


def test_relay_passes_bad_input_errors_through(servers):
    req = urllib.request.Request(servers["relay"] + "/v1/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 400 and "error" in json.loads(err.value.read())


async def test_remote_target_is_refused_before_any_request():
    with pytest.raises(ValueError, match="loopback"):
        await run_load(LoadSpec(url="http://192.0.2.1:8000", requests=1))


def test_gateway_overhead_relay_only_run_writes_results_and_leaves_nothing(tmp_path, capsys):
    before = set(descendants(os.getpid()))
    rc = gateway_overhead.main(["--no-pulse", "--clients", "1", "2", "--repeats", "1", "--warmup", "1",
                                "--duration", "0.3", "--tokens", "8", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("gateway_overhead-*.json")).read_text())
    assert {r["config"] for r in doc["records"]} == {"direct@1", "relay@1", "direct@2", "relay@2"}
    assert doc["protocol"] == {"repeats": 1, "warmup": 1, "order": doc["protocol"]["order"]}
    assert doc["summary"]["relay@2"]["added_ttft_p50_ms"]["n"] == 1
    assert doc["summary"]["relay@1"]["errors"]["max"] == 0
    # the relay path's CPU per request covers both of its processes
    relay_rec = next(r for r in doc["records"] if r["config"] == "relay@2")
    assert relay_rec["metrics"]["path_cpu_ms_per_req"] > 0
    assert len(relay_rec["detail"]["cpu_ms_per_req_by_process"]) >= 1
    assert next(tmp_path.glob("*.png")).stat().st_size > 0
    assert "| relay@1 |" in capsys.readouterr().out
    assert set(descendants(os.getpid())) <= before, "the benchmark left processes running"


def _state(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_stop_kills_and_names_what_survives_sigterm(tmp_path):
    # a child that moved to its own session and ignores SIGTERM: what Ray's actors look like to us
    proc = Proc("stubborn", ["sh", "-c", "setsid sh -c 'trap \"\" TERM; sleep 60' & sleep 60"], tmp_path)
    deadline = time.monotonic() + 5
    while len(descendants(proc.popen.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the outer sleep, the setsid shell and its sleep (a shell may exec the last one)
    kids = descendants(proc.popen.pid)
    assert len(kids) >= 2
    left = proc.stop(grace=2, settle=0.5)
    assert any("sleep" in name for name in left), left
    assert all(_state(pid) in ("gone", "Z") for pid in kids), [(pid, _state(pid)) for pid in kids]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gateway_overhead_against_pulse_serve_loadtest(tmp_path):
    """The whole benchmark with `pulse serve --backend loadtest` (tiny counts): Pulse answers every request
    with the same 16 tokens as the upstream, and nothing it started outlives the benchmark."""
    before = set(descendants(os.getpid()))
    rc = gateway_overhead.main(["--clients", "1", "4", "--repeats", "1", "--warmup", "0", "--duration", "0.5",
                                "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("gateway_overhead-*.json")).read_text())
    for cfg in ("pulse@1", "pulse@4"):
        rec = next(r for r in doc["records"] if r["config"] == cfg)
        m = rec["metrics"]
        assert m["ok"] > 0 and m["errors"] == 0 and m["rate_limited"] == 0, rec
        assert m["tok_s"] == pytest.approx(16 * m["req_s"])
    assert "req_s_vs_relay" in doc["summary"]["pulse@4"]
    assert len(doc["verdict"]) == 2 * len(gateway_overhead.goals(4))  # each goal judged at 1 and 4 clients
    assert set(descendants(os.getpid())) <= before, "the benchmark left processes running"


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    """The port free_port() gave is bound by someone else before the relay binds it: the relay exits with
    EADDRINUSE, and Served starts it again on the next free port."""
    import socket

    from bench import procs as procs_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first_port = taken.getsockname()[1]
        ports = iter([first_port, procs_module.free_port()])
        monkeypatch.setattr(procs_module, "free_port", lambda: next(ports))
        started: list = []
        try:
            served = Served(started, "upstream", lambda port: python_module(
                "bench.relay", "upstream", "--port", str(port), "--tokens", "2"), tmp_path)
            first = served.proc
            url = served.ready(20)
            assert first.popen.returncode is not None
            assert "address already in use" in (tmp_path / f"upstream.port-{first_port}-taken.log").read_text().lower()
            assert started == [served.proc] and url.endswith(f":{served.port}")
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                assert r.status == 200
        finally:
            for proc in started:
                proc.stop()
