"""LlamaServerBackend against a real llama-server running the real bundled model (one process per module)."""
from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from bench import llama_server_log, llama_server_stall
from cache.hashing import chain_hashes
from policy.profiles import builtin_profiles
from tests.integration.llama_server_helpers import (
    check_interleaved_restore,
    collect,
    direct_answer,
    encode,
    make_backend,
    make_config,
    request,
)
from workers.llama_server.backend import LlamaServerBackend
from workers.protocol import BackendError, SamplingParams
from workers.protocol.model import SMOLLM2_BUNDLED, load_model_info

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "The three primary colours are red, yellow and blue. Explain how to mix green paint, step by step:"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory):
    events = []
    backend = make_backend(tmp_path_factory.mktemp("llama"), sink=events.append)
    await backend.start()
    yield backend, events
    await backend.close()


def direct_completion(backend, prompt: list[int], n: int) -> dict:
    """llama-server's own non-streaming answer, bypassing Pulse: the reference for the streamed one."""
    return direct_answer(backend, {"prompt": prompt, "n_predict": n, "temperature": 0.0})


async def test_stream_matches_llama_servers_own_answer(served):
    backend, _ = served
    prompt = encode(PROMPT)
    chunks = await collect(backend, request("s1", prompt, max_tokens=24))
    final = chunks[-1]
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    text = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    ref = direct_completion(backend, prompt, 24)
    assert text == ref["content"] and ids == ref["tokens"]
    assert final.finish_reason == "length"
    # usage comes from llama-server's timings, and agrees with what was streamed
    assert final.usage.completion_tokens == 24 == len(ids)
    assert final.usage.prompt_tokens == len(prompt)


async def test_shared_prefix_is_served_from_the_slot_cache(served):
    backend, events = served
    base = encode(PROMPT + " First, take a clean palette and a brush. " * 6)
    assert len(base) > 64
    first = (await collect(backend, request("c1", base, max_tokens=4)))[-1].usage
    second = (await collect(backend, request("c2", base + encode(" Then")[1:], max_tokens=4)))[-1].usage
    assert first.prompt_tokens == len(base)
    assert second.cached_tokens >= len(base) - 16, (first, second)  # the slot kept the first prompt
    assert second.prompt_tokens == len(base) + len(encode(" Then")) - 1
    added = {h for e in events if e.kind == "added" for h in e.hashes}
    assert set(chain_hashes(base, backend.block_size, backend.model.chain_root.hash)) <= added  # the model's root


async def test_slot_affinity_picks_the_slot_holding_the_prefix(served):
    backend, _ = served
    lane = backend.lanes[0]
    a = encode("Alpha story: " + "once upon a time there was a fox. " * 5)
    b = encode("Beta recipe: " + "mix flour, water and salt. " * 5)
    await collect(backend, request("a1", a, max_tokens=2))
    await collect(backend, request("b1", b, max_tokens=2))
    slot_a = next(s.index for s in lane.slots.slots if s.tokens[: len(a)] == a)
    slot_b = next(s.index for s in lane.slots.slots if s.tokens[: len(b)] == b)
    assert slot_a != slot_b
    assert lane.slots.choose(a + [1, 2, 3]) == slot_a and lane.slots.choose(b) == slot_b
    usage = (await collect(backend, request("a2", a + encode(" The end")[1:], max_tokens=2)))[-1].usage
    assert usage.cached_tokens >= len(a) - 16


async def test_a_recorded_request_has_a_llama_server_client_span_with_its_slot_and_timings(served):
    """docs/METRICS.md's `pulse.llama_server` span: under the worker's span of the request, a CLIENT span with when
    the request was sent and when llama-server's headers came, the slot Pulse named and the one it ran in, and
    llama-server's own timings; none when the request's span is not recorded."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    backend, _ = served
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    kept, backend.tracer = backend.tracer, provider.get_tracer("test")
    prompt = encode("Gamma note: " + "the river runs to the sea. " * 4)
    try:
        with provider.get_tracer("test").start_as_current_span("pulse.prefill") as parent:
            chunks = await collect(backend, request("t1", prompt, max_tokens=3))
        off = TracerProvider(sampler=ALWAYS_OFF).get_tracer("off")
        with off.start_as_current_span("pulse.prefill"):
            await collect(backend, request("t2", prompt, max_tokens=3))
    finally:
        backend.tracer = kept
    spans = [s for s in exporter.get_finished_spans() if s.name == "pulse.llama_server"]
    assert len(spans) == 1  # the unrecorded request made none
    (span,) = spans
    assert span.kind == trace.SpanKind.CLIENT and span.parent.span_id == parent.get_span_context().span_id
    sent, headers, first = span.events
    assert (sent.name, headers.name, first.name) == \
        ("pulse.llama_server.sent", "pulse.llama_server.headers", "pulse.llama_server.first_token")
    assert span.start_time <= sent.timestamp <= headers.timestamp <= first.timestamp <= span.end_time
    a = span.attributes
    assert a["pulse.llama_server.slot_named"] in (-1, a["pulse.llama_server.slot"])
    assert 0 <= a["pulse.llama_server.slot"] < len(backend.lanes[0].slots.slots)
    assert a["pulse.llama_server.beyond_slots"] is False and a["pulse.llama_server.running"] == 0
    assert a["pulse.llama_server.predicted_n"] == 3 == chunks[-1].usage.completion_tokens
    assert a["pulse.llama_server.prompt_n"] + a["pulse.llama_server.cache_n"] == len(prompt)
    assert a["pulse.llama_server.prompt_ms"] > 0 and a["pulse.llama_server.predicted_ms"] > 0
    assert span.status.is_ok


async def test_without_slot_affinity_llama_server_picks_and_pulse_still_tracks_the_slot(tmp_path):
    events = []
    backend = make_backend(tmp_path, sink=events.append, slot_affinity=False)
    await backend.start()
    try:
        lane = backend.lanes[0]

        def refuse(prompt):
            raise AssertionError("Pulse chose a slot with slot_affinity off")
        lane.slots.choose = refuse
        a = encode("Alpha story: " + "once upon a time there was a fox. " * 5)
        await collect(backend, request("a1", a, max_tokens=2))
        held = [s for s in lane.slots.slots if s.tokens[: len(a)] == a]
        assert len(held) == 1 and not held[0].busy  # learned from llama-server's id_slot, released at the end
        added = {h for e in events if e.kind == "added" for h in e.hashes}
        assert set(chain_hashes(a, backend.block_size, backend.model.chain_root.hash)) <= added
        usage = (await collect(backend, request("a2", a + encode(" The end")[1:], max_tokens=2)))[-1].usage
        assert usage.cached_tokens >= len(a) - 16  # llama-server's own similarity rule found the same slot
    finally:
        await backend.close()


async def test_the_servers_log_times_each_launch(tmp_path):
    """bench.llama_server_log reads this binary's --log-timestamps log: Pulse's pinned launch, then one llama-server
    picks itself for a different prompt (so it saves the slot's old prompt into its RAM cache first)."""
    backend = make_backend(tmp_path, slots=1, extra_args=["--log-timestamps"])
    await backend.start()
    try:
        await collect(backend, request("p1", encode("Alpha story: " + "once upon a time there was a fox. " * 5), 3))
        direct_answer(backend, {"prompt": encode("Beta recipe: mix flour and water."), "n_predict": 2,
                                "cache_prompt": True})
    finally:
        await backend.close()
    (log,) = tmp_path.glob("llama-server-*.log")
    launches = llama_server_log.parse_file(log)
    assert [x.pick for x in launches] == ["id", "similarity" if launches[-1].f_keep is not None else "lru"]
    assert all(x.prompt_ms is not None and x.prompt_tokens and x.ms_per_token for x in launches)
    assert all(0 <= x.wait_ms < 30_000 for x in launches)


async def test_more_clients_than_slots_never_wait_for_a_named_busy_slot(tmp_path):
    """Six closed-loop clients on two slots, all starting at once: a request Pulse sends to a slot must find it idle.
    One sent to a slot llama-server had just given to a queued request waits for that slot's whole generation, and
    kept the clients pinned in pairs (the parity bench's 8 clients on 4 slots: 1,481 such picks in one run); so does
    one overtaken on the way by a request sent after it with no slot. Read from llama-server's own log: every pick
    is launched at once."""
    backend = make_backend(tmp_path, slots=2, extra_args=["--log-timestamps"])
    await backend.start()
    prompt = encode("Alpha story: " + "once upon a time there was a fox. " * 3)

    async def client(c: int) -> list[str]:
        return [(await collect(backend, request(f"c{c}r{r}", prompt, 4)))[-1].finish_reason for r in range(4)]
    try:
        finishes = await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(6))), 240)
    finally:
        await backend.close()
    assert finishes == [["length"] * 4] * 6
    (log,) = tmp_path.glob("llama-server-*.log")
    launches = llama_server_log.parse_file(log)
    assert len(launches) == 24
    with log.open(errors="replace") as fh:
        assert llama_server_log.deferred_picks(fh) == 0


async def test_stop_string_is_honoured_and_not_returned(served):
    backend, _ = served
    prompt = encode(PROMPT)
    full = "".join(c.text for c in await collect(backend, request("f", prompt, max_tokens=24)))
    words = [w for w in full.split() if len(w) >= 4]
    assert words, full
    stop = words[len(words) // 2]
    chunks = await collect(backend, request("st", prompt, max_tokens=24, stop=[stop]))
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert stop not in text and full.startswith(text) and len(text) < full.index(stop) + 1


async def test_sampling_seed_and_logprobs(served):
    backend, _ = served
    prompt = encode("Write a list of fruits:")
    hot = SamplingParams(temperature=1.2, top_p=0.95, top_k=50, seed=1234)
    runs = ["".join(c.text for c in await collect(backend, request(f"r{i}", prompt, 12, sampling=hot)))
            for i in range(2)]
    assert runs[0] == runs[1]  # the same seed and prompt give the same tokens
    chunks = await collect(backend, request("lp", prompt, 4, logprobs=3))
    lps = [lp for c in chunks if c.logprobs for lp in c.logprobs]
    ids = [t for c in chunks for t in c.token_ids]
    assert [lp.token_id for lp in lps] == ids
    assert all(lp.logprob <= 0 and len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1] for lp in lps)
    assert lps[0].top[0][0] == ids[0]  # greedy: the chosen token is the most likely one


async def test_bad_requests_are_400_before_any_output(served):
    backend, _ = served
    too_long = encode("word " * 5000)  # longer than the 4096-token KV
    with pytest.raises(BackendError) as e:
        await collect(backend, request("big", too_long, 4))
    assert e.value.status == 400
    with pytest.raises(BackendError) as e:
        await collect(backend, request("g", encode("hi"), 4, grammar="{not json"))
    assert e.value.status == 400


async def test_grammar_forces_a_json_object(served):
    backend, _ = served
    chunks = await collect(backend, request("j", encode("A person as JSON:"), 40, grammar="{}"))
    text = "".join(c.text for c in chunks)
    if chunks[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


async def test_early_close_and_cancel_free_the_slot(served):
    backend, _ = served
    prompt = encode(PROMPT)
    gen = backend.generate(request("e1", prompt, 200, ignore_eos=True))
    async for _ in gen:
        break
    await gen.aclose()
    assert backend.stats().running == 0
    seen = []
    async for c in backend.generate(request("e2", prompt, 200, ignore_eos=True)):
        seen.append(c)
        if len(seen) == 2:
            await backend.cancel("e2")
    assert seen[-1].finish_reason == "cancelled" and len(seen) < 20
    assert backend.stats().running == 0
    assert (await collect(backend, request("e3", prompt, 3)))[-1].finish_reason == "length"


async def test_slot_bookkeeping_returns_to_idle_after_cancels_and_early_closes(tmp_path):
    """Ten requests on two slots, some cancelled while queued, some closed after their first chunk, some run out:
    afterwards no slot is held, no request counts as unplaced, as named-not-started or as launching (a leak would
    stop Pulse naming slots, or hold every request with no slot), and a named pick works again."""
    backend = make_backend(tmp_path, slots=2)
    await backend.start()
    lane = backend.lanes[0]
    prompt = encode(PROMPT)

    async def one(i: int) -> str:
        gen = backend.generate(request(f"k{i}", prompt, 40, ignore_eos=True))
        try:
            async for c in gen:
                if i % 3 == 1:  # closed after its first chunk
                    return "closed"
                if c.finish_reason is not None:
                    return c.finish_reason
        finally:
            await gen.aclose()
        return "ended"

    async def cancel_later(i: int, after_s: float) -> None:
        await asyncio.sleep(after_s)
        await backend.cancel(f"k{i}")
    try:
        tasks = [asyncio.create_task(one(i)) for i in range(10)]
        # k0 goes to a named slot and is cancelled before its first event; k8 waits with no slot
        await asyncio.gather(cancel_later(0, 0.0), cancel_later(2, 0.05), cancel_later(5, 0.3), cancel_later(8, 0.0))
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert {outcomes[i] for i in (1, 4, 7)} == {"closed"} and outcomes[0] == "cancelled"
        assert set(outcomes) <= {"closed", "cancelled", "length"} and "length" in outcomes
        assert backend.stats().running == 0
        assert lane.slots.unplaced == 0 and lane.slots.named == 0 and lane.slots.launching == 0
        assert all(s.holders == 0 and not s.busy for s in lane.slots.slots)
        assert lane.slots.choose(prompt) is not None
        assert (await collect(backend, request("after", prompt, 3)))[-1].finish_reason == "length"
    finally:
        await backend.close()


async def test_stats_and_health(served):
    backend, _ = served
    s = backend.stats()
    assert await backend.health() and s.healthy
    assert s.slots == 2 and s.running == 0 and s.block_size == 16
    assert s.kv_blocks_total == 4096 // 16 and 0 < s.kv_blocks_used <= s.kv_blocks_total
    # as many beyond the slots as slots, in llama-server's own queue (arrival order); the gateway's default is 4
    assert s.queue_max == 2


async def test_the_gpu_draw_path_reserves_again_on_every_request_and_answers_right(tmp_path, served):
    """With --backend-sampling (the h200 profile's GPU draw; llama.cpp's CPU backend runs the same sampler graph here)
    every request attaches its sampler chain at its start and detaches it at its end, and each makes the context
    reserve its compute graphs again (deploy/llama_patches/0001 keeps the scheduler's buffers across those). Greedy
    answers, request after request, are the host draw's tokens exactly; then mixed requests at once on the two slots
    (greedy, temperature 1, logprobs and a grammar, which take the host draw) all finish (before
    deploy/llama_patches/0002 such a round could leave a launched request unprocessed for good: RELIABILITY.md)."""
    host, _ = served
    backend = make_backend(tmp_path, slots=2, extra_args=["--backend-sampling"])
    await backend.start()
    try:
        assert "--backend-sampling" in backend.lanes[0].process.argv_for(0)  # this binary takes the flag
        prompts = [encode(f"Note {i}: {PROMPT}") for i in range(4)]
        for i, prompt in enumerate(prompts):
            want = [t for c in await collect(host, request(f"h{i}", prompt, 12)) for t in c.token_ids]
            got = [t for c in await collect(backend, request(f"g{i}", prompt, 12)) for t in c.token_ids]
            assert got == want and len(got) == 12, (i, got, want)
        hot = SamplingParams(temperature=1.0)
        mixed = [request("m0", prompts[0], 10), request("m1", prompts[1], 10, sampling=hot),
                 request("m2", prompts[2], 6, logprobs=2), request("m3", encode("A person as JSON:"), 12, grammar="{}"),
                 request("m4", prompts[3], 10, sampling=hot), request("m5", prompts[1], 8)]
        results = await asyncio.wait_for(asyncio.gather(*(collect(backend, r) for r in mixed)), 120)
        for r, chunks in zip(mixed, results):
            assert chunks[-1].finish_reason in ("stop", "length"), (r.request_id, chunks[-1])
            assert any(c.token_ids for c in chunks), r.request_id
        assert all(lp.logprob <= 0 for c in results[2] if c.logprobs for lp in c.logprobs)
    finally:
        await backend.close()


async def test_requests_pinned_to_busy_slots_all_finish_with_their_own_answers(tmp_path):
    """llama.cpp 11434 ran its prompt-cache update on a busy slot when a request pinned to it (`id_slot`, Pulse's slot
    affinity) arrived: the cached prompt that best matched the new request replaced the running one's, which then
    never finished its prompt (or, caught generating, went on from the wrong KV). deploy/llama_patches/0002 leaves the
    busy slot alone. Rounds of six requests at once on two slots with Pulse's flags (unified KV, the RAM prompt cache
    on, as the cpu, cuda, gb10 and thor profiles run it), four pinned: every request ends within 30 s, and each
    greedy one gives the answer it gives alone (the unpatched build stalled in round 2 or 3 of six tries of 40)."""
    backend = make_backend(tmp_path, slots=2)
    await backend.start()

    def post(body: dict) -> list[int]:  # a stalled request fails here, after 30 s
        return direct_answer(backend, {"cache_prompt": True, **body}, timeout=30)["tokens"]

    # counting: a greedy continuation with a wide margin at every token, different for each note: batching's
    # rounding is unlikely to flip it, another note's KV would change it
    note = [encode(f"Note {i}: counting up, " + ", ".join(str(n) for n in range(100 * i + 11, 100 * i + 23)) + ",")
            for i in range(4)]
    round_ = llama_server_stall.round_of(note, encode("A person as JSON:"))  # bench.llama_server_stall's round
    try:
        alone = {i: post(b) for i, b in enumerate(round_) if b["temperature"] == 0 and "json_schema" not in b}
        for n in range(8):
            got = await asyncio.gather(*(asyncio.to_thread(post, b) for b in round_))
            for i, want in alone.items():
                assert got[i] == want, (n, i, got[i], want)
    finally:
        await backend.close()


async def test_a_prompt_saved_from_interleaved_cells_comes_back_whole(tmp_path, monkeypatch):
    """llama-server's RAM prompt cache saves a slot's sequence (`llama_state_seq_get_data`) when a launch is about to
    discard it, and loads it back for a later request that starts with it. On GPU buffers deploy/llama_patches/0003
    reads a saved sequence's nearby cell ranges as one span and copies them out on the host; PULSE_STATE_COPY_GAP makes
    this CPU build take that path too. The round (llama_server_helpers.check_interleaved_restore): a note generated
    beside another, displaced from its slot by a third prompt, continued from the cache with the note's own tokens."""
    monkeypatch.setenv("PULSE_STATE_COPY_GAP", "65536")
    smol = load_model_info(SMOLLM2_BUNDLED)
    backend = LlamaServerBackend(make_config(tmp_path, slots=2), builtin_profiles()["cpu"], smol, worker_id="t")
    await backend.start()
    try:
        await check_interleaved_restore(backend)
    finally:
        await backend.close()
