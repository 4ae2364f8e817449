"""Two lanes on one worker: llama-server with a drafter and without, chosen per request by K.

The bundled model drafts for itself here: no second small model ships with Pulse, and a model drafting
for itself exercises the same machinery (draft_n / draft_n_accepted from llama-server's timings).
"""
from __future__ import annotations

from tests.integration.llama_server_helpers import collect, encode, make_backend, request
from workers.protocol.model import bundled_model_path


async def test_k_zero_goes_to_the_plain_process_and_k_above_zero_drafts(tmp_path):
    backend = make_backend(tmp_path, draft_model=str(bundled_model_path()), draft_max=3, slots=1,
                           spec_type="draft-simple")
    await backend.start()
    try:
        assert [lane.name for lane in backend.lanes] == ["spec", "plain"] and len(set(backend.pids())) == 2
        prompt = encode("Count from one to twenty: one, two, three,")
        # the cpu profile's table gives K = 4 (capped to draft_max by the process) at low concurrency
        spec = (await collect(backend, request("s", prompt, 24)))[-1].usage
        plain = (await collect(backend, request("p", prompt, 24, max_draft_tokens=0)))[-1].usage
        assert spec.drafted_tokens > 0 and 0 < spec.accepted_tokens <= spec.drafted_tokens, spec
        assert plain.drafted_tokens == 0 and plain.accepted_tokens == 0, plain
        assert spec.completion_tokens == plain.completion_tokens == 24
        assert backend.stats().slots == 2
    finally:
        await backend.close()
