"""The status page in a real headless Chromium (Debian's, driven by Playwright) against a real `pulse serve`
with two engine workers on the CPU: every worker and its live tokens/s, the charts, a chat streamed through
the "Try it" box, phone and 4k widths, and, once keys exist, the key prompt and no fleet data without one.

Screenshots go to the test's tmp directory; their paths are printed (pytest -s shows them).
The keyed test comes last: creating a key switches the running gateway to keyed for the rest of the module.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import PulseProcess

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
MODEL = "gemma-3-270m"
# Chromium as root in a container: no sandbox, nothing reaching out (updates, sync, QUIC probes)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
WAIT_MS = 60_000

CONFIG = """
keys: {{file: "{tmp}/keys.json"}}
model: {{name: gemma-3-270m}}
workers:
  count: 2
  backend: cupy
  engine: {{device: cpu, kv_blocks: 256, max_num_seqs: 2}}
server:
  drain_grace_s: 5
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("status-page")
    srv = PulseProcess([], CONFIG.format(tmp=tmp), tmp).wait_ready(300)
    srv.keys_file = tmp / "keys.json"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: deploy/install.sh --test installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    # a fresh profile directory for this run (Playwright passes it as --user-data-dir)
    ctx = pw.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium-profile")),
                                                executable_path=CHROMIUM, headless=True, args=FLAGS,
                                                viewport={"width": 1440, "height": 1000})
    try:
        yield ctx
    finally:
        ctx.close()
        pw.stop()


@pytest.fixture
def page(browser, server):
    """A new tab (its own sessionStorage) that records every URL the page asks for."""
    pg = browser.new_page()
    pg.requested = []
    pg.on("request", lambda req: pg.requested.append(req.url))
    yield pg
    assert all(url.startswith(server.base + "/") or url.startswith("data:") for url in pg.requested), pg.requested
    pg.close()


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class Traffic:
    """Chats in a background thread until stopped (or 120 s, or 200 requests): the workers' tokens/s."""

    def __init__(self, base: str):
        self.base, self.done, self.statuses = base, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(3)]

    def _run(self, i: int) -> None:
        deadline = time.monotonic() + 120
        while not self.done.is_set() and time.monotonic() < deadline and len(self.statuses) < 200:
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"Count to ten, take {i}."}],
                               "max_tokens": 24, "ignore_eos": True}).encode()
            req = urllib.request.Request(self.base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
                self.statuses.append(r.status)

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for t in self.threads:
            t.join(90)


def shot(pg, tmp_path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def worker_ids(server) -> list[str]:
    status, _, body = get(server.base + "/pulse/workers")
    assert status == 200, body
    ids = [w["worker_id"] for w in json.loads(body)["workers"]]
    assert len(ids) == 2, ids
    return ids


def test_page_is_self_contained_and_its_json_is_live(server):
    status, headers, html = get(server.base + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert get(server.base + "/ui")[2] == html
    for name in ("status.js", "status.css"):
        status, _, body = get(server.base + "/ui/" + name)
        assert status == 200 and b"https://" not in body, name
    assert b"https://" not in html and b"http://" not in html
    assert get(server.base + "/ui/../app.py")[0] == 404
    assert get(server.base + "/ui/secret.txt")[0] == 404
    status, _, body = get(server.base + "/pulse/status?since=soon")
    assert status == 400 and json.loads(body)["error"]["param"] == "since"
    s = json.loads(get(server.base + "/pulse/status")[2])
    assert s["access"] == "open" and s["models"] == [MODEL]
    assert sorted(w["id"] for w in s["workers"]) == sorted(worker_ids(server))
    assert s["series"]["points"] and time.time() - s["series"]["points"][-1][0] < 3.5  # a reading every 2 s
    later = json.loads(get(server.base + f"/pulse/status?since={s['series']['points'][-1][0]}")[2])
    assert all(p[0] > s["series"]["points"][-1][0] for p in later["series"]["points"])


def unknown_model(server, secret: str) -> None:
    """A chat naming a model that is not served (404, whose message quotes the name back to its caller)."""
    body = json.dumps({"model": secret, "messages": [{"role": "user", "content": secret}]}).encode()
    req = urllib.request.Request(server.base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 404 and secret.encode() in e.value.read()


def test_recent_errors_name_the_code_but_repeat_nothing_a_client_sent(server):
    secret = "my-private-prompt-text"
    unknown_model(server, secret)
    status, _, raw = get(server.base + "/pulse/status")
    assert status == 200 and secret.encode() not in raw
    err = json.loads(raw)["errors"][0]
    assert (err["status"], err["code"], err["path"], err["message"]) == (404, "model_not_found",
                                                                          "/v1/chat/completions", None)


def test_page_shows_every_worker_and_live_tokens_per_s(server, page, tmp_path):
    ids = worker_ids(server)
    unknown_model(server, "no-such-model")
    with Traffic(server.base) as traffic:
        page.goto(server.base + "/")
        for wid in ids:
            page.wait_for_selector(f'#workers article[data-worker="{wid}"]', timeout=WAIT_MS)
        # the first figure in each card is its tokens/s; the workers' rate covers their last 5 s
        page.wait_for_function("""() => [...document.querySelectorAll('#workers article dd')]
            .filter((dd, i) => dd.parentElement.firstChild.textContent === 'Tokens/s')
            .some(dd => parseFloat(dd.textContent.replace(/,/g, '')) > 0)""", timeout=WAIT_MS)
        page.wait_for_selector("#chart-tps path.line", timeout=WAIT_MS)
        page.wait_for_function("() => document.querySelector('#chart-ttft path.line, #chart-ttft circle.dot')",
                               timeout=WAIT_MS)
        text = page.inner_text("#workers")
        assert all(wid in text for wid in ids), text
        assert "healthy" in text and MODEL in text and "KV blocks" in text
        assert "Places + its queue" in text and " + 4" in text  # the CPU profile says no queue: the gateway's 4
        page.wait_for_function("() => document.getElementById('conn').textContent === '2/2 workers healthy'",
                               timeout=WAIT_MS)
        assert "model_not_found" in page.inner_text("#errors")
        shot(page, tmp_path, "status-page")
    assert traffic.statuses and set(traffic.statuses) == {200}
    # the gateway's minute figures count that traffic
    page.wait_for_function("""() => { const t = [...document.querySelectorAll('#gateway-tiles .tile')]
        .find(t => t.querySelector('.label').textContent === 'Requests/s');
        return t && parseFloat(t.querySelector('.value').textContent) > 0; }""", timeout=WAIT_MS)


def test_try_it_streams_a_chat_with_its_tokens_per_s(server, page, tmp_path):
    page.goto(server.base + "/")
    page.wait_for_selector(f"#try-model option[value='{MODEL}']", state="attached", timeout=WAIT_MS)
    page.get_by_label("Model").select_option(MODEL)
    page.get_by_label("Message").fill("Name three colours.")
    page.get_by_label("Max tokens").fill("24")
    # count the writes into the answer: a streamed answer arrives in several
    page.evaluate("""() => { window.answerWrites = 0; new MutationObserver(() => window.answerWrites++)
        .observe(document.getElementById('try-output'), {childList: true, characterData: true, subtree: true}); }""")
    for _ in range(3):  # the box samples (temperature 1): a rare answer ends at once; ask again then
        page.evaluate("window.answerWrites = 0")
        page.get_by_role("button", name="Send").click()
        page.wait_for_selector("#try-stats[data-state='done']", timeout=WAIT_MS)
        answer, stats = page.inner_text("#try-output"), page.inner_text("#try-stats")
        if answer.strip() and int(stats.split(" token")[0]) >= 8:
            break
    assert answer.strip() and int(stats.split(" token")[0]) >= 8, stats
    assert page.evaluate("window.answerWrites") > 3, "the answer did not stream"
    rate = float(stats.split(" tokens/s")[0].rsplit("·", 1)[1].strip().replace(",", ""))
    assert rate > 0 and "worker " in stats, stats
    shot(page, tmp_path, "try-it")


@pytest.mark.parametrize("width,height,scheme", [(390, 844, "dark"), (3840, 2160, "light")])
def test_fits_a_phone_and_a_4k_screen(server, page, tmp_path, width, height, scheme):
    page.set_viewport_size({"width": width, "height": height})
    page.emulate_media(color_scheme=scheme)
    page.goto(server.base + "/")
    page.wait_for_selector("#workers article", timeout=WAIT_MS)
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    # every control has an accessible name (a label, or text for buttons)
    unnamed = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea, button')]
        .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.textContent.trim())
        .map(e => e.id)""")
    assert unnamed == []
    shot(page, tmp_path, f"status-{width}")


def create_key(server, *extra: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pulse.cli", "keys", "create", "--keys-file", str(server.keys_file),
                          *extra], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def test_keyed_page_asks_for_a_key_and_shows_no_fleet_data(server, page, tmp_path):
    ids = worker_ids(server)
    admin, plain = create_key(server, "--admin"), create_key(server)
    deadline = time.monotonic() + 15
    while get(server.base + "/pulse/status")[0] != 401:  # the gateway re-reads its keys every 2 s
        assert time.monotonic() < deadline, "keys did not switch auth on"
        time.sleep(0.3)
    assert get(server.base + "/pulse/status", {"Authorization": f"Bearer {plain}"})[0] == 403
    status, _, body = get(server.base + "/pulse/status", {"Authorization": f"Bearer {admin}"})
    assert status == 200 and admin.encode() not in body and plain.encode() not in body

    page.goto(server.base + "/")
    page.get_by_role("textbox", name="API key", exact=True).wait_for(timeout=WAIT_MS)
    assert page.is_hidden("#fleet") and page.is_hidden("#try")
    html = page.content()
    assert not any(wid in html for wid in ids)
    shot(page, tmp_path, "key-prompt")

    page.get_by_role("textbox", name="API key", exact=True).fill(plain)  # not admin: the chat box, still no fleet
    page.get_by_role("button", name="Use key").click()
    page.wait_for_selector("#scope-notice", state="visible", timeout=WAIT_MS)
    page.wait_for_selector("#try", state="visible", timeout=WAIT_MS)
    assert page.is_hidden("#fleet") and not any(wid in page.content() for wid in ids)
    shot(page, tmp_path, "plain-key")

    page.get_by_role("button", name="Forget key").click()
    page.get_by_role("textbox", name="API key", exact=True).fill(admin)
    page.get_by_role("button", name="Use key").click()
    for wid in ids:
        page.wait_for_selector(f'#workers article[data-worker="{wid}"]', timeout=WAIT_MS)
    assert admin not in page.content()
