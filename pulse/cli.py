"""The `pulse` command: serve, doctor, keys.

Flags are a thin layer over PulseConfig: each one sets one config field, so a flag, a YAML key and a
PULSE_* environment variable are three spellings of the same setting.
"""
from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

# flag -> config path; argparse only parses, PulseConfig validates
SERVE_FLAGS = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "backend": ("workers", "backend"),
    "workers": ("workers", "count"),
    "redis_url": ("redis", "url"),
    "model": ("model", "path"),
    "device_profile": ("workers", "device_profile"),
    "gateway_replicas": ("server", "gateway_replicas"),
    "ray_address": ("server", "ray_address"),
    "pipeline_stages": ("workers", "engine", "pipeline_stages"),
}


def _overrides(args: argparse.Namespace, flags: dict) -> dict:
    out: dict = {}
    for attr, path in flags.items():
        value = getattr(args, attr, None)
        if value is not None:
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = value
    return out


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (single box by default)")
    p.add_argument("--config", help="YAML config file (see policy/config.py for every field)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--backend", help="cupy | llama-server | loadtest (the gateway-overhead instrument); default: "
                   "the device profile's (llama-server on a CPU box, the engine on a CUDA GPU)")
    p.add_argument("--workers", type=int, help="worker actors (default: one per GPU, one on a CPU box)")
    p.add_argument("--redis-url", dest="redis_url", help="Redis for the prefix index and keys (default in-process)")
    p.add_argument("--model", help="serve only this GGUF file or bundled model (gemma-3-270m, smollm2-135m-instruct); "
                   "default: both bundled models, or the config's models")
    p.add_argument("--device-profile", dest="device_profile", help="device profile name (default: detected)")
    p.add_argument("--gateway-replicas", dest="gateway_replicas", type=int, help="gateway ingress replicas")
    p.add_argument("--ray-address", dest="ray_address", help="join this Ray cluster ('auto': the running one)")
    p.add_argument("--pipeline-stages", dest="pipeline_stages", type=int,
                   help="split each engine's layers across N stage actors (pipeline parallelism)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pulse", description="Pulse: an LLM serving gateway on Ray Serve")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("doctor", help="check this machine before a benchmark", add_help=False)
    sub.add_parser("keys", help="manage API keys (create, list, revoke)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "doctor":
        from pulse.doctor import doctor_main

        return doctor_main(argv[1:])
    if argv and argv[0] == "keys":
        from pulse.keys_cli import keys_main

        return keys_main(argv[1:])
    args = build_parser().parse_args(argv)
    from pulse.config import load_config
    from pulse.logs import setup_logging

    try:
        config = load_config(args.config, _overrides(args, SERVE_FLAGS))
    except (ValidationError, ValueError, OSError) as e:
        print(f"pulse: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    setup_logging(config)
    from pulse.serve import serve_main

    return serve_main(config)


if __name__ == "__main__":
    sys.exit(main())
