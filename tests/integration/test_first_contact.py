"""A new user's first minutes, against the default `pulse serve` (no flags, no config): the README's Python
example runs verbatim, both bundled models are listed and chat, an unknown model is a 404 naming them.

The server is started as the README's set-up command says (`pulse serve`), on a free port instead of 8000
(the README's address is rewritten to it in the example, its only change), with no config file, so it runs
the device profile's default backend and both bundled models.
"""
from __future__ import annotations

import json
import re
import subprocess
import urllib.request
import sys

import openai
import pytest

from tests.conftest import ROOT, PulseProcess

INSTRUCT = "smollm2-135m-instruct"


def use_it() -> str:
    return (ROOT / "README.md").read_text().split("\n## Use it\n", 1)[1].split("\n## ", 1)[0]


def readme_python() -> str:
    """The first Python block of the README's "Use it" section: the OpenAI client example."""
    return re.findall(r"```python\n(.*?)```", use_it(), re.S)[0]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first-contact")
    # no keys file of the user's: the open single-box default the README describes
    srv = PulseProcess([], None, tmp, env={"PULSE_KEYS__FILE": str(tmp / "keys.json")}).wait_ready(300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.base + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_the_readme_example_runs_verbatim(default_server, tmp_path):
    code = readme_python()
    assert 'api_key="unused"' in code and "stream=True" in code and "http://127.0.0.1:8000/v1" in code
    script = tmp_path / "readme_example.py"
    script.write_text(code.replace("http://127.0.0.1:8000/v1", default_server.base + "/v1"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    shown = readme_output()
    assert lines == shown, f"the README shows {shown}; the example printed {lines}"


def test_the_readme_responses_and_anthropic_example_runs_verbatim(default_server, tmp_path):
    """The second Python block (Responses with a stored turn, then Anthropic's client) after the first one,
    whose `client` it uses: it runs, and prints answers after the first block's lines."""
    first, second = re.findall(r"```python\n(.*?)```", use_it(), re.S)[:2]
    assert "previous_response_id" in second and "Anthropic(" in second
    code = (first + second).replace("http://127.0.0.1:8000/v1", default_server.base + "/v1")
    script = tmp_path / "readme_example2.py"
    script.write_text(code.replace("http://127.0.0.1:8000", default_server.base))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    shown = readme_output()
    assert lines[:len(shown)] == shown and "".join(lines[len(shown):]).strip(), lines


def readme_output() -> list[str]:
    """The output the README shows for its example (the plain block right after it)."""
    after = use_it().split("```python\n", 1)[1].split("```", 1)[1]
    return re.search(r"```\n(.*?)```", after, re.S).group(1).splitlines()


def test_both_bundled_models_are_listed(client):
    assert [m.id for m in client.models.list().data] == ["gemma-3-270m", INSTRUCT]
    assert client.models.retrieve("smollm2").id == INSTRUCT  # an alias finds it


def test_the_instruct_model_answers_the_question(client):
    r = client.chat.completions.create(model=INSTRUCT, temperature=0, max_tokens=16, messages=[
        {"role": "user", "content": "What is the capital of France? Answer in one word."}])
    assert "Paris" in r.choices[0].message.content and r.model == INSTRUCT


def test_the_base_model_still_chats_in_its_own_turn_format(client):
    r = client.chat.completions.create(model="gemma-3-270m", temperature=0, max_tokens=8,
                                       messages=[{"role": "user", "content": "Hello"}])
    assert r.model == "gemma-3-270m" and r.usage.completion_tokens > 0


def get_json(url: str, body: dict | None = None) -> tuple[dict, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), dict(r.headers)


def test_each_model_runs_on_its_own_workers(default_server):
    rows = get_json(default_server.base + "/pulse/workers")[0]["workers"]
    by_model = {row["model"]: row for row in rows}
    assert set(by_model) == {"gemma-3-270m", INSTRUCT}
    for model, row in by_model.items():
        _, headers = get_json(default_server.base + "/v1/chat/completions", {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert headers["x-pulse-worker"] == row["worker_id"]


def test_an_unknown_model_is_a_404_naming_the_served_ones(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "gemma-3-270m" in err["message"] and INSTRUCT in err["message"]


def test_workers_run_the_backend_their_device_profile_names(default_server):
    """No backend configured: each worker runs its profile's default_backend (on a CPU box, llama-server:
    BENCHMARKS.md, "Default backend on a CPU box")."""
    from policy.profiles import builtin_profiles, select_profile

    for row in get_json(default_server.base + "/pulse/workers")[0]["workers"]:
        assert row["backend"] == select_profile(row["device"], builtin_profiles()).default_backend, row
