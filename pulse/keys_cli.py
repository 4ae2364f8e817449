"""`pulse keys create|list|revoke`: manage API keys in the store `pulse serve` reads.

    exit_code = keys_main(argv, config)   # argv after "keys", e.g. ["create", "--rpm", "60"]

The store is the Redis at config.redis.url when set, else the single-box keys file (config.keys.file,
default ~/.config/pulse/keys.json). `create` prints the new key once, alone on stdout (so
`KEY=$(pulse keys create)` works), and its details on stderr; the key is not stored and cannot be
shown again. `list` never shows keys or digests. `revoke KEY_ID` exits 1 if no such active key.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from gateway.keys import ApiKey, KeysUnavailable, open_key_store


def _parser(config) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pulse keys", description="Manage Pulse API keys.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="create a key and print it once")
    c.add_argument("--name", default="", help="a label for people (shown by list)")
    c.add_argument("--rpm", type=int, default=config.keys.default_rpm, help="requests per minute (0: unlimited)")
    c.add_argument("--tpm", type=int, default=config.keys.default_tpm, help="tokens per minute (0: unlimited)")
    c.add_argument("--concurrency", type=int, default=config.keys.default_concurrency,
                   help="requests in flight at once (0: unlimited)")
    c.add_argument("--admin", action="store_true", help="allow admin endpoints (keys, drain, checkpoints)")
    ls = sub.add_parser("list", help="list keys (never the keys themselves)")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.add_argument("--all", action="store_true", help="include revoked keys")
    r = sub.add_parser("revoke", help="revoke a key by its id (the 12 hex digits after pk_)")
    r.add_argument("key_id")
    return p


def keys_main(argv: list[str], config) -> int:
    args = _parser(config).parse_args(argv)
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
            plaintext, key = await store.create(args.name, args.rpm, args.tpm, args.concurrency, args.admin)
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

    return ", ".join((one(k.rpm, "rpm"), one(k.tpm, "tpm"), one(k.concurrency, "concurrent")))


def _print_list(keys: list[ApiKey], as_json: bool) -> None:
    if as_json:
        for k in keys:
            print(json.dumps(k.public(), sort_keys=True))
        return
    print(f"{'KEY ID':<14}{'NAME':<20}{'RPM':>7}{'TPM':>10}{'CONC':>6}  {'ADMIN':<6}{'CREATED':<21}STATUS")
    for k in keys:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(k.created_at))
        status = "active" if k.active else "revoked"
        print(f"{k.key_id:<14}{k.name[:19]:<20}{k.rpm:>7}{k.tpm:>10}{k.concurrency:>6}  "
              f"{'yes' if k.admin else 'no':<6}{created:<21}{status}")
