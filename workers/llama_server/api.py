"""llama-server's native /completion API as Pulse uses it: the request body and the streamed events.

Pulse sends the gateway's token ids as the prompt (no second tokenization) and reads usage from the
final event's `timings`, never by counting events: one event can carry several tokens (speculation).
"""
from __future__ import annotations

import json

import msgspec

from workers.protocol import BackendError, GenerateRequest, SamplingParams, TokenLogprob, Usage


class Timings(msgspec.Struct):
    cache_n: int = 0  # prompt tokens reused from the slot's KV
    prompt_n: int = 0  # prompt tokens evaluated now
    predicted_n: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0


class TopLogprob(msgspec.Struct):
    id: int
    logprob: float = 0.0


class TokenProbs(msgspec.Struct):
    id: int
    logprob: float = 0.0
    top_logprobs: list[TopLogprob] = []


class Event(msgspec.Struct):
    """One `data:` line of the stream (partial or final); unknown fields are ignored."""

    content: str = ""
    tokens: list[int] = []
    stop: bool = False
    stop_type: str = ""
    id_slot: int = -1
    timings: Timings | None = None
    tokens_cached: int = 0
    tokens_evaluated: int = 0
    tokens_predicted: int = 0
    completion_probabilities: list[TokenProbs] | None = None
    error: dict | None = None


decode_event = msgspec.json.Decoder(Event).decode
_encode = msgspec.json.Encoder().encode
FINISH = {"eos": "stop", "word": "stop", "limit": "length"}
# Fields of the final event Pulse reads: the rest (generation settings, the prompt as text) is not sent.
RESPONSE_FIELDS = ["content", "tokens", "stop", "stop_type", "id_slot", "timings", "tokens_cached",
                   "tokens_evaluated", "tokens_predicted", "completion_probabilities"]


def request_body(req: GenerateRequest, id_slot: int | None, exact_seed: bool = False) -> bytes:
    """The /completion body for `req` on slot `id_slot` (None: llama-server picks). `exact_seed` (a GPU server): a
    seeded request is evaluated from its first prompt token (`cache_prompt` off), as its first run was."""
    s = req.sampling
    body: dict = {
        "prompt": req.prompt_ids,
        "n_predict": req.max_tokens,
        "stream": True,
        "cache_prompt": True,
        "return_tokens": True,
        "id_slot": -1 if id_slot is None else id_slot,
        **sampler_settings(s),
        "response_fields": RESPONSE_FIELDS,
    }
    if s.seed is not None:
        body["seed"] = s.seed
        # A seeded request draws on the host. llama.cpp's GPU draw (--backend-sampling, the h200 profile: a
        # float32 cumulative sum over the whole vocabulary, compared with the seed's uniform) did not repeat a
        # seeded request's tokens on the H200 (the second of two identical temperature-1 requests left the
        # first at token 16 of 24; tests/gpu/test_llama_server_gpu.py). The host draw repeats on the CPU box
        # (tests/integration/test_llama_server_backend.py). On the H200 it does not either (2026-12-02: the same
        # GPU test, the second request left the first at token 15): the second request reuses the slot's cached
        # prompt and re-evaluates only its last token, in a batch of one, so that token's K/V and the logits after
        # it come out of other CUDA kernels than the first request's whole-prompt batch (llama.cpp issue 2838; its
        # maintainers' advice for determinism is to turn the prompt cache off, and a GB10 report there shows even
        # greedy output changing on a cached repeat). So on a GPU server a seeded request, which asks for the same
        # tokens again, is evaluated from scratch: it pays its prompt's prefill, no other request does. On the
        # H200 (2026-12-02, 0823fa8) that repeats only on the same slot: llama-server called directly with the
        # unified KV and the cache off gave the same seeded request the same tokens on its slot and others from
        # the second token on another slot (where its cells sit changes the kernels' sums), and a 32-slot server
        # behind Pulse parted at token 15. So on a GPU server of several slots a seed is best effort, as OpenAI
        # documents its own; tests/gpu/test_llama_server_gpu.py checks the repeat on one slot. Grammars and
        # logprobs take the host draw anyway.
        body["backend_sampling"] = False
        if exact_seed:
            body["cache_prompt"] = False
    if req.stop:
        body["stop"] = req.stop
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.logprobs is not None:
        body["n_probs"] = max(1, req.logprobs)  # 0 alternatives still needs the chosen token's logprob
    if req.grammar is not None:
        body["json_schema"] = _schema(req.grammar)
    return _encode(body)


def sampler_settings(s: SamplingParams) -> dict:
    """llama-server's sampler fields for `s`: the same distribution, by the cheapest path llama.cpp has.

    llama.cpp (build 11434, common/sampling.cpp) samples on the host: every token it copies all the
    logits (262k for Gemma 3) into a candidate array and runs the chain penalties, dry, top_n_sigma,
    top_k, typical, top_p, min_p, xtc, temperature, then `dist`. Samplers at their neutral values
    return at once; `dist` takes a softmax (one expf per candidate) over whatever the chain left.
    - Greedy (`SamplingParams.greedy`: temperature under 1e-5, or top_k 1): `top_k 1`. Top-k 1 keeps the first highest logit in one pass
      (std::partial_sort of one element), so `dist` sees one candidate; temperature 0 with top_k 0
      reaches the same token only after the softmax over the whole vocabulary. Same token, ties
      included (both keep the first maximum). With a grammar the chain runs again after the grammar
      when its pick is rejected, so top_k 1 picks the best allowed token, as greedy must.
    - Sampled: the fields as given, top_k 0 (off) and min_p 0 by default. Nothing sorts the vocabulary
      here: top_p 1 and min_p 0 return at once, top_p < 1 sorts only the top 256 unless they hold less
      than p. The softmax over the whole vocabulary is what sampling from it costs; llama-server's own
      defaults (top_k 40, top_p 0.95, min_p 0.05) are cheaper because they change the distribution,
      so they are not sent (min_p in particular must always be sent: its default is 0.05, not 0).
    Logprobs come from the raw logits (llama-server's pre-sampling probabilities), so top_k 1 does not
    change them.
    - Presence / frequency penalties, when set, go as given: llama.cpp's penalty sampler comes first in the
      chain (so greedy's top_k 1 picks among penalized logits), but it counts the last `repeat_last_n` (64)
      tokens of the prompt and the output together, where OpenAI (and Pulse's engine) count the whole output
      and no prompt. That is llama-server's own definition, the one a user calling it directly gets.
    """
    penalties = ({"presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty}
                 if s.penalized else {})
    if s.greedy:
        return {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, **penalties}
    return {"temperature": s.temperature, "top_k": max(0, s.top_k), "top_p": s.top_p, "min_p": s.min_p, **penalties}


def _schema(grammar: str) -> dict:
    try:
        schema = json.loads(grammar)
    except ValueError as e:
        raise BackendError(f"grammar is not a JSON schema: {e}", 400, "invalid_request_error") from None
    return schema or {"type": "object"}  # "{}" means any JSON object


def logprobs_of(ev: Event, n: int) -> list[TokenLogprob] | None:
    if ev.completion_probabilities is None:
        return None
    return [TokenLogprob(token_id=p.id, logprob=p.logprob, top=[(t.id, t.logprob) for t in p.top_logprobs[:n]])
            for p in ev.completion_probabilities]


def usage_of(ev: Event, prompt_tokens: int) -> Usage:
    t = ev.timings or Timings()
    return Usage(prompt_tokens=ev.tokens_evaluated or prompt_tokens, completion_tokens=t.predicted_n, cached_tokens=t.cache_n,
                 drafted_tokens=t.draft_n, accepted_tokens=t.draft_n_accepted)


def error_of(status: int, body: bytes) -> BackendError:
    """llama-server's error body ({"error": {"code", "message", "type"}}) as a BackendError."""
    try:
        err = json.loads(body).get("error", {})
        message, kind = str(err.get("message", "")), str(err.get("type", ""))
    except (ValueError, AttributeError):
        message, kind = body[:500].decode(errors="replace"), ""
    if 400 <= status < 500:
        # The gateway validated the request, so a 4xx here is a limit of this backend (e.g. context size).
        return BackendError(f"llama-server: {message}", 400, kind or "invalid_request_error")
    return BackendError(f"llama-server answered {status}: {message}", 503, "backend_unavailable")
