"""gateway.open_guard: which Host and Origin names an open gateway answers to."""
from __future__ import annotations

import pytest

from gateway.open_guard import _host_of, local_name


@pytest.mark.parametrize("header, bind, expected", [
    ("127.0.0.1:8000", "127.0.0.1", True),
    ("localhost:8000", "127.0.0.1", True),
    ("LOCALHOST.", "127.0.0.1", True),
    ("app.localhost:8000", "127.0.0.1", True),
    ("[::1]:8000", "::1", True),
    ("127.0.0.2", "127.0.0.1", True),         # all of 127/8 is loopback
    ("pulse.test:8000", "pulse.test", True),  # the bind name itself
    ("evil.example:8000", "127.0.0.1", False),
    ("localhost.evil.example", "127.0.0.1", False),
    ("127.0.0.1.evil.example", "127.0.0.1", False),
    ("10.0.0.5:8000", "127.0.0.1", False),
    ("", "127.0.0.1", False),
])
def test_local_names(header, bind, expected):
    assert local_name(_host_of(header), bind) is expected
