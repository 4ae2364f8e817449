"""Pulse's own inference engine: one engine per device, CuPy on a GPU, NumPy on a CPU, same code.

The parts, by file:
- device.py     picks the array module (`xp`: numpy or cupy) once at start
- weights.py    GGUF tensors, dequantized once and cached on disk as .npy
- ops.py        the compute primitives (rmsnorm, rope, paged attention, lm head, ...) over `xp`
- models.py     GGUF architecture name -> model class (and its GPU counterpart in gpu/)
- gemma3.py     the Gemma 3 architecture
- llama.py      Llama-family architectures (Llama 2/3, SmolLM, ...): GQA, RoPE scaling, SwiGLU
- kv_cache.py   paged KV: fixed-size blocks, block tables, content-addressed prefix reuse, LRU eviction
- sequence.py   one request's state inside the engine
- scheduler.py  continuous batching, chunked prefill under a token budget, preemption by recompute
- batch.py      the flattened inputs of one step (token ids, positions, KV slots, block tables)
- sampler.py    greedy / temperature / top-k / top-p / min-p with per-request seeds, logprobs
- drafter.py    draft tokens for speculation: prompt lookup (n-grams) and Predicted Outputs
- speculative.py  speculation: K per step from policy.speculation, one-forward verification, rollback
- constrain.py  grammar-constrained decoding (llguidance masks applied before sampling)
- engine.py     the step loop: schedule, run the model, sample, update sequences
- engine_loop.py  the step thread: adds and aborts in, step outputs handed over in batches
- engine_process.py  that step thread in a process of its own (the GPU default), token ids over a socketpair
- backend.py    EngineBackend: the worker's Backend, the step thread (here or in the engine process) bridged to
                asyncio, detokenizing and stop strings per request
- gpu/          the CUDA half: fused kernels, cuBLAS through ctypes, decode steps as CUDA graphs
"""
