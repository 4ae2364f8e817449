"""What a test needs from the machine: a skip on a developer's box, a failure where it must be there.

Under CI (`CI=true`) the install (deploy/install.sh --test) provides every tool the suite uses, so an absent
one is a broken install and fails the test instead of hiding it behind a skip. A variable such as
PULSE_REQUIRE_GPU=1 makes the same demand on a machine CI does not cover (the GPU box).
"""
from __future__ import annotations

import os

import pytest


def required(env: str | None = None) -> bool:
    """Whether a missing tool fails the test here: always under CI, or where `env` is set to a true value."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return True
    return bool(env and os.environ.get(env, "").lower() in ("1", "true", "yes"))


def absent(what: str, *, env: str | None = None) -> None:
    """Fail (CI, or `env` set) or skip the calling test because `what` is not on this machine."""
    if required(env):
        pytest.fail(f"{what} (required here{f': {env} is set' if env and os.environ.get(env) else ': CI'})",
                    pytrace=False)
    pytest.skip(what, allow_module_level=True)
