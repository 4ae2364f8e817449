"""Keeps helm/pulse/values.schema.json's `$defs` equal to Pulse's config model (policy/config.py).

The chart's own values are described by hand in values.schema.json; `pulse.config` refers to
`#/$defs/PulseConfig`, which this script derives from the pydantic models, so `helm install` rejects a
Pulse config that Pulse itself would reject (unknown keys, wrong types, out-of-range numbers).

    python helm/tools/values_schema.py          # rewrite the $defs
    python helm/tools/values_schema.py --check  # exit 1 when they are stale (CI)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from policy.config import PulseConfig

SCHEMA = Path(__file__).resolve().parents[1] / "pulse" / "values.schema.json"
# Helm neither shows these nor applies schema defaults; leaving them out also means only a change to what
# is accepted (a field, a type, a range) makes values.schema.json stale, not a reworded description.
_DROP = {"title", "default", "description"}
_CHART_DEFS = {"ResourceRequirements"}  # written by hand in values.schema.json, kept as they are


def _clean(node, names: bool = False):
    """Drop _DROP keywords from a schema; under `properties` the keys are field names, kept as they are."""
    if isinstance(node, dict):
        return {k: _clean(v, names=(k == "properties" and not names))
                for k, v in node.items() if names or k not in _DROP}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def pulse_defs() -> dict:
    model = PulseConfig.model_json_schema()
    defs = {name: _clean(d) for name, d in model.pop("$defs").items()}
    defs["PulseConfig"] = _clean(model)
    return dict(sorted(defs.items()))


def render(current: dict) -> str:
    kept = {k: v for k, v in current.get("$defs", {}).items() if k in _CHART_DEFS}
    return json.dumps({**current, "$defs": dict(sorted({**kept, **pulse_defs()}.items()))}, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="fail when values.schema.json is stale")
    opts = args.parse_args(argv)
    text = SCHEMA.read_text()
    fresh = render(json.loads(text))
    if opts.check:
        if fresh != text:
            print(f"{SCHEMA} is stale: run python helm/tools/values_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
