"""Property-based fuzzing of the HTTP API against a running server: no 5xx, no crash, OpenAI-shaped errors.

CI runs PULSE_FUZZ_EXAMPLES (default 400) per strategy; the full count (>= 10,000 in total) is
`PULSE_FUZZ_EXAMPLES=2500 python3 -m pytest tests/integration/test_fuzz_api.py` (see RELIABILITY.md).
"""
from __future__ import annotations

import http.client
import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("PULSE_FUZZ_EXAMPLES", "400"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
MODEL = "gemma-3-270m"
PATHS = ["/v1/chat/completions", "/v1/completions"]

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(allow_nan=False), st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                             st.dictionaries(st.text(max_size=12), c, max_size=4)),
                           max_leaves=20)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "n", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "max_draft_tokens",
          "prediction", "tools", "tool_choice", "response_format", "min_p", "presence_penalty", "unknown_field"]


def base_request(path: str) -> dict:
    if path.endswith("chat/completions"):
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2}


class Client:
    def __init__(self, base: str):
        host, port = base.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)

    def post(self, path: str, body: bytes, ctype: str = "application/json") -> tuple[int, bytes]:
        for attempt in range(2):
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": ctype})
                r = self.conn.getresponse()
                return r.status, r.read()
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()  # the server closed a keep-alive connection after an error; reconnect once
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
                if attempt:
                    raise
        raise AssertionError("unreachable")


def check(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:300])
    data = json.loads(body) if body and not body.startswith(b"data:") else None
    if status >= 400:
        err = data["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert {"type", "param", "code"} <= set(err)
    elif data is not None:
        assert "choices" in data


@given(path=st.sampled_from(PATHS), field=st.sampled_from(FIELDS), value=json_values)
@FUZZ
def test_fuzz_field_values(loadtest_server, path, field, value):
    req = base_request(path)
    req[field] = value
    if field in ("max_tokens", "max_completion_tokens") and type(value) is int and 8 < value < 8192:
        req[field] = 3  # a valid large value would only make the stream long; larger ones hit the context check
    c = Client(loadtest_server.base)
    status, body = c.post(path, json.dumps(req).encode())
    if not body.startswith(b"data:"):
        check(status, body)
    else:
        assert status == 200 and body.rstrip().endswith(b"data: [DONE]")


@given(path=st.sampled_from(PATHS), body=st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode())))
@FUZZ
def test_fuzz_raw_bodies(loadtest_server, path, body):
    status, resp = Client(loadtest_server.base).post(path, body)
    check(status, resp)


@given(path=st.sampled_from(PATHS), cut=st.integers(min_value=0, max_value=60),
       ctype=st.sampled_from(["application/json", "text/plain", "application/xml", "multipart/form-data",
                              "application/octet-stream", ""]),
       depth=st.integers(min_value=0, max_value=5000))
@FUZZ
def test_fuzz_truncated_deep_and_content_types(loadtest_server, path, cut, ctype, depth):
    full = json.dumps(base_request(path)).encode()
    body = full[:cut] if cut < len(full) else b"[" * depth + b"]" * depth
    status, resp = Client(loadtest_server.base).post(path, body, ctype)
    check(status, resp)


@given(path=st.sampled_from(PATHS), junk=st.binary(min_size=1, max_size=40))
@FUZZ
def test_fuzz_invalid_utf8_in_strings(loadtest_server, path, junk):
    full = json.dumps(base_request(path)).encode()
    body = full.replace(b'"hi"', b'"' + junk.replace(b'"', b"").replace(b"\\", b"") + b'\xff\xfe"')
    status, resp = Client(loadtest_server.base).post(path, body)
    check(status, resp)
