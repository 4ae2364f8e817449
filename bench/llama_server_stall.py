"""Reproduces a stall in llama-server (llama.cpp 11434): a request is launched on a slot and never processed.

Two slots, the unified KV (as Pulse runs llama-server), and rounds of six concurrent /completion requests, some
pinned to a slot (`id_slot`, Pulse's slot affinity), some not, mixing greedy, temperature 1, `n_probs` and a JSON
schema. Within a few rounds one request's slot logs `launch_slot_` and then nothing: no prompt eval, no release;
the other slot goes on serving, and requests pinned to the stuck slot wait behind it for good: llama-server had
loaded a cached prompt into the busy slot a pinned request asked for (RELIABILITY.md). Seen on the 2-core box with
and without `--backend-sampling`; deploy/llama_patches/0002 fixes it (40 rounds, no stall), `--cache-ram 0` avoids
it. Prints the round it stalled in and the stuck tasks from the server's log; exit 1 on a stall.

    python -m bench.llama_server_stall                                   # Pulse's cached build, the bundled Gemma
    python -m bench.llama_server_stall --binary /tmp/llama-server-0001-only --flags=--backend-sampling --rounds 40
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from bench.procs import Proc, free_port, owned_processes
from workers.llama_server.binary import find_llama_server
from workers.protocol.model import load_model_info

BASE = "The three primary colours are red, yellow and blue. Explain how to mix green paint:"


def round_of(notes: Sequence, schema_prompt) -> list[dict]:
    """One round's six /completion bodies on two slots, four pinned: `notes` are four prompts (text or token ids),
    `schema_prompt` the one answered under a JSON schema."""
    return [{"prompt": notes[0], "n_predict": 10, "temperature": 0, "id_slot": 0},
            {"prompt": notes[1], "n_predict": 10, "temperature": 1.0, "id_slot": -1},
            {"prompt": notes[2], "n_predict": 6, "temperature": 0, "n_probs": 2, "id_slot": 1},
            {"prompt": schema_prompt, "n_predict": 12, "temperature": 0, "json_schema": {"type": "object"},
             "id_slot": -1},
            {"prompt": notes[3], "n_predict": 10, "temperature": 1.0, "id_slot": 0},
            {"prompt": notes[1], "n_predict": 8, "temperature": 0, "id_slot": 1}]


ROUND = round_of([f"Note {i}: {BASE}" for i in range(4)], "A person as JSON:")


def stuck_tasks(log: str) -> list[str]:
    """Tasks the log shows launched and never released (`launch_slot_` without a later `release` of that task)."""
    launched = re.findall(r"launch_slot_: id\s+(\d+) \| task (\d+)", log)
    released = set(re.findall(r"release: id\s+\d+ \| task (\d+)", log))
    return [f"slot {slot} task {task}" for slot, task in launched if task not in released]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.llama_server_stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=None, help="llama-server (default: Pulse's cached build)")
    ap.add_argument("--flags", default="", help="more llama-server flags, one string, e.g. --flags=--backend-sampling")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take before it counts stuck")
    args = ap.parse_args(argv)
    binary, port = find_llama_server(args.binary), free_port()
    cmd = [str(binary), "-m", load_model_info().path, "--host", "127.0.0.1", "--port", str(port), "-np", "2",
           "-c", "4096", "-t", "1", "--kv-unified", *args.flags.split()]
    url = f"http://127.0.0.1:{port}"

    def post(body: dict) -> dict:
        req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            return json.load(r)

    with owned_processes() as procs:
        server = Proc("llama-server", cmd, Path(tempfile.mkdtemp(prefix="llama-stall-")))
        procs.append(server)
        server.wait_healthy(url + "/health", 120)
        with cf.ThreadPoolExecutor(len(ROUND)) as pool:
            for n in range(args.rounds):
                try:
                    list(pool.map(post, ROUND))
                except TimeoutError:
                    print(f"{binary} {args.flags}: stalled in round {n + 1} of {args.rounds}; launched and "
                          f"never released: {', '.join(stuck_tasks(server.log_path.read_text())) or 'none found'}; "
                          f"log: {server.log_path}")
                    return 1
    print(f"{binary} {args.flags}: {args.rounds} rounds of {len(ROUND)}, no stall")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
