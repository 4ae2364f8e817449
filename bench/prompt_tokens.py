"""Gateway prompt building (render + tokenize) for a growing agent conversation: whole text against pieces.

The conversation is bench/routing.py's synthetic agent session (1.5k-word system prompt, tool results of
300-900 words); its 10th turn is ~9.4k tokens. Configurations, interleaved per bench/protocol.py, one timed
`PromptBuilder.chat` call per step:
- whole:        today's path before gateway/piece_tokens.py: the whole rendered text tokenized every time;
- after_1_9:    a fresh piece cache that has seen turns 1-9 (untimed), then turn 10 (only its new messages miss);
- cold:         a fresh, empty piece cache, turn 10 (every piece misses: the first request of a conversation);
- repeat:       turn 10 again after it was seen (every piece hits);
- render_only:  the Jinja rendering alone, the floor under all of them.
Each step also checks the ids against the whole-text ids.

    python -m bench.prompt_tokens --repeats 15 --warmup 3
"""
from __future__ import annotations

import argparse
import os
import time

from bench.protocol import schedule, summarize
from bench.routing import TraceSpec, build_trace
from gateway.openai_types import Message
from gateway.piece_tokens import PieceTokenizer
from gateway.prompt import PromptBuilder
from workers.protocol.model import load_model_info, load_tokenizer

CONFIGS = ("whole", "after_1_9", "cold", "repeat", "render_only")


def conversation(turns: int) -> list[list[Message]]:
    session = build_trace(TraceSpec(sessions=1, turns=turns, system_words=1500, tool_words=(300, 900)), "x")[0]
    return [[Message(role=m["role"], content=m["content"]) for m in msgs] for _, msgs, *_ in session]


def step(config: str, builder: PromptBuilder, tok, cuts: list[str], turns: list[list[Message]]) -> float:
    last = turns[-1]
    if config == "render_only":
        t = time.perf_counter()
        builder._template.render(messages=[{"role": m.role, "content": m.content} for m in last],
                                 tools=None, add_generation_prompt=True, bos_token="")
        return time.perf_counter() - t
    builder.pieces = PieceTokenizer(tok, [] if config == "whole" else cuts)
    for earlier in turns[:-1] if config == "after_1_9" else turns[-1:] if config == "repeat" else []:
        builder.chat(earlier)
    t = time.perf_counter()
    prompt = builder.chat(last)
    elapsed = time.perf_counter() - t
    if prompt.ids[1:] != tok.encode(prompt.text, add_special_tokens=False).ids:
        raise AssertionError(f"{config}: ids differ from whole-text tokenization")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled model)")
    args = ap.parse_args(argv)
    info, tok = load_model_info(args.model), load_tokenizer(args.model)
    builder = PromptBuilder(tok, architecture=info.architecture, bos_token_id=info.bos_token_id,
                            add_bos=info.add_bos, template=info.chat_template)
    cuts, turns = builder.pieces.cuts, conversation(args.turns)
    load_before = os.getloadavg()
    records = [{"phase": s.phase, "config": s.config,
                "metrics": {"ms": 1000 * step(s.config, builder, tok, cuts, turns)}}
               for s in schedule(CONFIGS, args.repeats, args.warmup)]
    summary = summarize(records)
    ntok = len(builder.chat(turns[-1]).ids)
    print(f"turn {len(turns)}: {ntok} tokens; cuts {cuts}; load avg before {load_before}, after {os.getloadavg()}")
    print("| config | median ms | min | max | n |\n|---|---|---|---|---|")
    for config in CONFIGS:
        s = summary[config]["ms"]
        print(f"| {config} | {s['median']:.2f} | {s['min']:.2f} | {s['max']:.2f} | {s['n']} |")


if __name__ == "__main__":
    main()
