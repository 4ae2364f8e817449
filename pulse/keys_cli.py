"""`pulse keys create|list|revoke`: manage API keys in the store `pulse serve` reads.

    exit_code = keys_main(argv)            # argv after "keys", e.g. ["create", "--rpm", "60"]
    exit_code = keys_main(argv, config)    # or with a PulseConfig already loaded

The store is the Redis at config.redis.url when set, else the single-box keys file (config.keys.file,
default ~/.config/pulse/keys.json): the same one `pulse serve` reads with the same settings. Every
subcommand takes `--config FILE`, `--redis-url URL` and `--keys-file PATH` (PULSE_* environment
variables apply too, as for `pulse serve`). `create` prints the new key once, alone on stdout (so
`KEY=$(pulse keys create)` works), and its details on stderr; the key is not stored and cannot be
shown again. `list` never shows keys or digests. `revoke KEY_ID` exits 1 if no such active key.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from pydantic import ValidationError

from gateway.keys import ApiKey, KeysUnavailable, open_key_store
from pulse.config import load_config, merge


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", help="YAML config file (the one `pulse serve` uses)")
    common.add_argument("--redis-url", dest="redis_url", help="act on the keys in this Redis")
    common.add_argument("--keys-file", dest="keys_file", help="act on this keys file (when no Redis)")
    p = argparse.ArgumentParser(prog="pulse keys", description="Manage Pulse API keys.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", parents=[common], help="create a key and print it once")
    c.add_argument("--name", default="", help="a label for people (shown by list)")
    c.add_argument("--rpm", type=int, help="requests per minute (0: unlimited; default keys.default_rpm)")
    c.add_argument("--tpm", type=int, help="tokens per minute (0: unlimited; default keys.default_tpm)")
    c.add_argument("--concurrency", type=int,
                   help="requests in flight at once (0: unlimited; default keys.default_concurrency)")
    c.add_argument("--admin", action="store_true", help="allow admin endpoints (keys, drain, checkpoints)")
    c.add_argument("--max-priority", dest="max_priority", type=int, default=0,
                   help="the admission priority of this key's requests (default 0; below 0: background); "
                        "a request's `priority` can only lower it")
    ls = sub.add_parser("list", parents=[common], help="list keys (never the keys themselves)")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.add_argument("--all", action="store_true", help="include revoked keys")
    r = sub.add_parser("revoke", parents=[common], help="revoke a key by its id (the 12 hex digits after pk_)")
    r.add_argument("key_id")
    return p


def _config(args, config):
    """The given config, or one loaded like `pulse serve` loads it; flags override either."""
    overrides: dict = {}
    if args.redis_url:
        overrides["redis"] = {"url": args.redis_url}
    if args.keys_file:
        overrides["keys"] = {"file": args.keys_file}
    if config is None:
        return load_config(args.config, overrides)
    if not overrides:
        return config
    return type(config).model_validate(merge(config.model_dump(), overrides))


def keys_main(argv: list[str], config=None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = _config(args, config)
    except (ValidationError, ValueError, OSError) as e:
        print(f"pulse keys: invalid configuration:\n{e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args, config))
    except KeysUnavailable as e:
        print(f"pulse keys: the key store is unreachable: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"pulse keys: {e}", file=sys.stderr)
        return 2


async def _run(args, config) -> int:
    store = open_key_store(config)
    try:
        if args.command == "create":
            d = config.keys
            limits = [d.default_rpm if args.rpm is None else args.rpm, d.default_tpm if args.tpm is None else args.tpm,
                      d.default_concurrency if args.concurrency is None else args.concurrency]
            plaintext, key = await store.create(args.name, *limits, admin=args.admin, max_priority=args.max_priority)
            print(plaintext)
            print(f"created key {key.key_id} ({_limits(key)}{', admin' if key.admin else ''}); "
                  "store it now: it is not shown again", file=sys.stderr)
            return 0
        if args.command == "list":
            keys = [k for k in await store.list() if args.all or k.active]
            _print_list(keys, args.json)
            return 0
        if await store.revoke(args.key_id):
            print(f"revoked {args.key_id}", file=sys.stderr)
            return 0
        print(f"no active key {args.key_id!r}", file=sys.stderr)
        return 1
    finally:
        await store.close()


def _limits(k: ApiKey) -> str:
    def one(n: int, unit: str) -> str:
        return f"{n} {unit}" if n else f"unlimited {unit}"

    return ", ".join((one(k.rpm, "rpm"), one(k.tpm, "tpm"), one(k.concurrency, "concurrent"),
                      f"priority {k.max_priority}"))


def _print_list(keys: list[ApiKey], as_json: bool) -> None:
    if as_json:
        for k in keys:
            print(json.dumps(k.public(), sort_keys=True))
        return
    print(f"{'KEY ID':<14}{'NAME':<20}{'RPM':>7}{'TPM':>10}{'CONC':>6}{'PRIO':>6}  {'ADMIN':<6}{'CREATED':<21}STATUS")
    for k in keys:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k.created_at))
        status = "active" if k.active else "revoked"
        print(f"{k.key_id:<14}{k.name[:19]:<20}{k.rpm:>7}{k.tpm:>10}{k.concurrency:>6}{k.max_priority:>6}  "
              f"{'yes' if k.admin else 'no':<6}{created:<21}{status}")
