"""Gemma 3 on a CUDA GPU: the same forward pass as workers/cupy/gemma3.py, from fused kernels and cuBLAS.

Per layer, 4 GEMMs (q/k/v as one, o, gate/up as one, down) and 5 fused kernels (sandwich norms with the
residual add, QK-norm + RoPE + KV write, paged attention, gelu * up). Weights, activations and the KV cache
are fp16 (or bf16); the residual stream and every GEMM output stay fp32, so Gemma's large residual values
never pass through a 16-bit type. Decode steps replay CUDA graphs (graphs.py), and so do speculative verify
steps (verify.py); other steps (prefill chunks) run eagerly.

The object has the interface the engine expects of a model (`xp`, `forward(batch, kv)`, `kv_storage`), so
`create_engine` can use it in place of the NumPy/CuPy-ops model when the device is a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cupy as cp
import numpy as np

from workers.cupy.gemma3 import Gemma3Config
from workers.cupy.gpu.cublas import Cublas
from workers.cupy.gpu.kernels import (ATT_MAX_SPLIT, GEMV_ADD_NORM, GEMV_EMBED, GEMV_MAX_M, GEMV_PLAIN, Kernels,
                                      argmax_chunks, attention_splits)
from workers.cupy.kv_cache import KVStorage


def to_device(a, act: str):
    """A host fp32 array in the activation dtype on the device (bf16 kept as its uint16 bit pattern)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if act == "float16":
        return cp.asarray(a.astype(np.float16))
    bits = a.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16  # round to nearest even
    return cp.asarray(rounded.astype(np.uint16))


def kv_dtype(act: str) -> str:
    return "float16" if act == "float16" else "uint16"


def device_kv_args(batch):
    """The step's KV slots and block tables on the device; (global, local) pairs when the sliding-window
    layers have their own pool (workers/cupy/kv_cache.py), which `run` hands each layer by its kind."""
    slots = cp.asarray(batch.slot_mapping, cp.int64)
    tables = cp.asarray(np.ascontiguousarray(batch.meta.block_tables, dtype=np.int32))
    if batch.local_meta is None:
        return slots, tables
    return ((slots, cp.asarray(batch.local_slot_mapping, cp.int64)),
            (tables, cp.asarray(np.ascontiguousarray(batch.local_meta.block_tables, dtype=np.int32))))


def _for_layer(x, lw):
    """A layer's own slots / block tables from a (global, local) pair; a single array serves every layer."""
    return x[0 if lw["window"] == 0 else 1] if isinstance(x, tuple) else x


# The paths a forward takes (GpuGemma3.forward): a captured decode graph, a captured verify graph (speculation's
# verify steps, and "mixed" steps: short prompt chunks beside decodes, verify.py), or eager.
STEP_KINDS = ("graph", "verify", "mixed", "eager")


@dataclass
class Workspace:
    """Every intermediate of one step for up to `t` tokens and `s` logits rows (graphs need fixed buffers)."""

    resid: cp.ndarray
    resid2: cp.ndarray  # the small-batch path ping-pongs the residual between the two
    x: cp.ndarray
    qkv: cp.ndarray
    q: cp.ndarray
    attn: cp.ndarray
    o: cp.ndarray
    gate_up: cp.ndarray
    mlp: cp.ndarray
    down: cp.ndarray
    x_out: cp.ndarray
    logits: cp.ndarray
    chosen: cp.ndarray
    part_v: cp.ndarray  # argmax stage-1 winners per row
    part_i: cp.ndarray
    att_part: cp.ndarray  # split decode attention: per token and split, unnormalised output, max, sum
    att_count: cp.ndarray  # per token: splits finished (the last one merges and resets it to 0)

    @classmethod
    def allocate(cls, c: Gemma3Config, t: int, s: int, act: str) -> Workspace:
        adt = kv_dtype(act)
        nq = c.n_heads * c.head_dim
        return cls(
            resid=cp.empty((t, c.hidden), cp.float32), resid2=cp.empty((t, c.hidden), cp.float32), x=cp.empty((t, c.hidden), adt),
            qkv=cp.empty((t, nq + 2 * c.n_kv_heads * c.head_dim), cp.float32), q=cp.empty((t, nq), adt),
            attn=cp.empty((t, nq), adt), o=cp.empty((t, c.hidden), cp.float32),
            gate_up=cp.empty((t, 2 * c.ffn), cp.float32), mlp=cp.empty((t, c.ffn), adt),
            down=cp.empty((t, c.hidden), cp.float32), x_out=cp.empty((s, c.hidden), adt),
            logits=cp.empty((s, c.vocab_size), cp.float32), chosen=cp.empty((s,), cp.int32),
            part_v=cp.empty((s, argmax_chunks(c.vocab_size)), cp.float32),
            part_i=cp.empty((s, argmax_chunks(c.vocab_size)), cp.int32),
            att_part=cp.empty((t, ATT_MAX_SPLIT, nq + 2 * c.n_heads), cp.float32),
            att_count=cp.zeros((t,), cp.uint32),
        )

    def view(self, t: int, s: int) -> Workspace:
        """The leading rows, for a step smaller than the buffers (still C-contiguous)."""
        tok = ("resid", "resid2", "att_part", "att_count", "x", "qkv", "q", "attn", "o", "gate_up", "mlp", "down")
        return Workspace(**{k: getattr(self, k)[: (t if k in tok else s)] for k in self.__dataclass_fields__})


class GpuGemma3:
    architecture = "gemma3"
    # The array module the engine builds each step's inputs with: host NumPy. The model uploads them itself,
    # as one packed copy on decode steps, instead of one CuPy transfer per array (~15 us each, per token).
    xp = np

    def __init__(self, cfg: Gemma3Config, weights: dict, act: str = "float16", graph_sizes=(1, 2, 4, 8, 16, 32, 64),
                 max_model_len: int = 8192, verify_sizes=(4, 8, 16, 32, 64, 128, 256)):
        if cfg.n_kv_heads != 1:
            raise ValueError("the GPU kernels are written for one KV head (Gemma 3 270M/1B)")
        self.cfg, self.act = cfg, act
        self.max_model_len = max_model_len
        self.rope = self._rope_tables(cfg, max_model_len)
        self.kernels = Kernels(cfg.head_dim, cfg.n_heads // cfg.n_kv_heads, act)
        self.blas = Cublas(act)
        self.embed = to_device(weights["token_embd.weight"], act)
        self.out_norm = cp.asarray(weights["output_norm.weight"], cp.float32)
        self.layers = [self._layer_weights(weights, i) for i in range(cfg.n_layers)]
        self.graph_sizes = tuple(sorted(graph_sizes))
        self._graphs = None  # graphs.DecodeGraphs, built on the first decode step for a KV storage
        # speculative verify steps (verify.py) of up to the largest size in tokens; () keeps them eager
        self.verify_sizes = tuple(sorted(verify_sizes))
        self._verify = None
        self.mixed_graphs = True  # steps with prompt chunks replay the verify graphs where they fit (verify.py)
        self.step_kinds = dict.fromkeys(STEP_KINDS, 0)  # forwards by path, for benchmarks and stats

    @property
    def mixed_step_tokens(self) -> int:
        """The most tokens a step carrying prompt chunks beside decodes can have and still replay a graph (the
        largest verify graph); 0 when such steps run eagerly. The scheduler fills a decoding step only up to it."""
        return self.verify_sizes[-1] if self.mixed_graphs and self.verify_sizes else 0

    @staticmethod
    def _rope_tables(cfg: Gemma3Config, n_pos: int) -> dict:
        """cos/sin per (base, scale) for every position, from the NumPy path's own function (float64 angles
        rounded to fp32 once), so both paths rotate by identical values."""
        from workers.cupy.ops import Ops

        out = {}
        for key in ((cfg.rope_base_local, 1.0), (cfg.rope_base_global, cfg.rope_scale_global)):
            cos, sin = Ops(np).rope_tables(np.arange(n_pos), key[0], cfg.head_dim, key[1])
            out[key] = (cp.asarray(cos), cp.asarray(sin))
        return out

    def _layer_weights(self, w: dict, i: int) -> dict:
        p, act = f"blk.{i}.", self.act

        def norm(name):
            return cp.asarray(w[p + name + ".weight"], cp.float32)

        qkv = np.concatenate([w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        gate_up = np.concatenate([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]])
        c = self.cfg
        is_global = c.is_global(i)
        return {
            "attn_norm": norm("attn_norm"), "qkv": to_device(qkv, act), "q_norm": norm("attn_q_norm"),
            "k_norm": norm("attn_k_norm"), "o": to_device(w[p + "attn_output.weight"], act),
            "post_attn_norm": norm("post_attention_norm"), "ffn_norm": norm("ffn_norm"),
            "gate_up": to_device(gate_up, act), "down": to_device(w[p + "ffn_down.weight"], act),
            "post_ffn_norm": norm("post_ffw_norm"),
            "rope": self.rope[(c.rope_base_global, c.rope_scale_global) if is_global else (c.rope_base_local, 1.0)],
            "window": 0 if is_global else c.window,
        }

    def kv_storage(self, num_blocks: int, block_size: int, dtype: str | None = None,
                   num_local: int | None = None) -> KVStorage:
        """K/V arrays with one extra block at the end of each pool: the scratch block padding rows of a graph
        write to. num_local: the sliding-window layers' own pool (workers/cupy/kv_cache.py); None: one pool."""
        c = self.cfg
        return KVStorage(cp, c.n_layers, num_blocks, block_size, c.n_kv_heads, c.head_dim, kv_dtype(self.act),
                         is_global=[c.is_global(i) for i in range(c.n_layers)], num_local=num_local, extra=1)

    # --- the step ------------------------------------------------------------------------------------
    def run(self, ws: Workspace, tok, pos, slots, tok_row, block_tables, logit_rows, kv: KVStorage,
            block_size: int, decode: bool = False, small: bool | None = None) -> None:
        """One forward pass into ws.logits / ws.chosen (greedy ids). Launches only: capturable as a graph.

        decode=True promises one query token per sequence (tok_row[t] == t): attention then does QK-norm,
        RoPE and the KV write itself. small (default: decode steps of up to GEMV_MAX_M tokens) takes the fused
        small-batch products; a step of several query tokens a sequence may take them too, with the KV write as its
        own kernel before attention (its tokens read each other's keys), but the verify graphs do not: cuBLAS ran
        them faster (verify.py)."""
        if small is None:
            small = decode
        small = small and tok.shape[0] <= GEMV_MAX_M
        if small:
            self._layers_small(ws, tok, pos, slots, tok_row, block_tables, kv, block_size, fused=decode)
        else:
            self._layers_blas(ws, tok, pos, slots, tok_row, block_tables, kv, block_size, decode)
        if logit_rows.shape[0] == 0:  # a prefill chunk short of its prompt's end: no logits (a 0-block launch fails)
            return
        last = self.layers[-1]
        resid = ws.resid2 if small else ws.resid
        self.kernels.add_norm(resid, ws.down, last["post_ffn_norm"], self.out_norm, self.cfg.eps, ws.x_out,
                              rows=logit_rows)
        self.blas.linear(ws.x_out, self.embed, ws.logits)
        if self.cfg.final_softcap:
            cap = np.float32(self.cfg.final_softcap)
            ws.logits[...] = cp.tanh(ws.logits / cap) * cap
        self.kernels.argmax_rows(ws.logits, ws.chosen, ws.part_v, ws.part_i)

    def _attention(self, i, lw, ws, pos, slots, tok_row, block_tables, kv, block_size, fused: bool, pdl=False):
        c = self.cfg
        # a two-pool storage needs (global, local) pairs: a single table would index the local pool with global ids
        assert isinstance(block_tables, tuple) == kv.two_pools, "KV slots/tables do not match the storage's pools"
        slots, block_tables = _for_layer(slots, lw), _for_layer(block_tables, lw)
        rcos, rsin = lw["rope"]
        fuse = (ws.qkv, lw["q_norm"], lw["k_norm"], slots, rcos, rsin, c.eps) if fused else None
        if not fused:
            self.kernels.qkv_post(ws.qkv, lw["q_norm"], lw["k_norm"], pos, slots, rcos, rsin, c.eps,
                                  c.n_heads, c.n_kv_heads, ws.q, kv.k[i], kv.v[i])
        # keys split across blocks when a step has few tokens (decode, verify), each reading a whole context:
        # one block per token over 16k keys left the GPU idle (verify steps at 16k context ran at half speed)
        n_split = attention_splits(pos.shape[0])
        self.kernels.attention(ws.q, kv.k[i], kv.v[i], block_tables, tok_row, pos, block_size, lw["window"],
                               c.query_scale, c.n_kv_heads, ws.attn, fused=fuse, pdl=pdl, n_split=n_split,
                               part=ws.att_part, counter=ws.att_count)

    def _layers_blas(self, ws, tok, pos, slots, tok_row, block_tables, kv, block_size, decode):
        """Any step size: cuBLAS products, separate norm and gelu kernels (9 launches a layer, 8 when decoding)."""
        c, k, blas, eps = self.cfg, self.kernels, self.blas, self.cfg.eps
        k.embed_norm(tok, self.embed, math.sqrt(c.hidden), self.layers[0]["attn_norm"], eps, ws.resid, ws.x)
        for i, lw in enumerate(self.layers):
            blas.linear(ws.x, lw["qkv"], ws.qkv)
            self._attention(i, lw, ws, pos, slots, tok_row, block_tables, kv, block_size, decode)
            blas.linear(ws.attn, lw["o"], ws.o)
            k.add_norm(ws.resid, ws.o, lw["post_attn_norm"], lw["ffn_norm"], eps, ws.x)
            blas.linear(ws.x, lw["gate_up"], ws.gate_up)
            k.gelu_mul(ws.gate_up, ws.mlp)
            blas.linear(ws.mlp, lw["down"], ws.down)
            if i + 1 < len(self.layers):
                k.add_norm(ws.resid, ws.down, lw["post_ffn_norm"], self.layers[i + 1]["attn_norm"], eps, ws.x)

    def _layers_small(self, ws, tok, pos, slots, tok_row, block_tables, kv, block_size, fused: bool = True):
        """Decode of <= GEMV_MAX_M tokens: 4 launches a layer (attention, o, the whole MLP, the next q/k/v), every
        norm and the gelu fused into a product (5 with fused=False: QK-norm/RoPE/KV write before attention).
        The residual ends each layer in resid2 (ra -> rb within a layer, rb -> ra across layers)."""
        c, k, eps, L = self.cfg, self.kernels, self.cfg.eps, self.layers
        ra, rb = ws.resid, ws.resid2
        k.gemv(GEMV_EMBED, L[0]["qkv"], ws.qkv, tok=tok, emb=self.embed, emb_scale=math.sqrt(c.hidden),
               w_norm=L[0]["attn_norm"], resid_out=ra, eps=eps, pdl=True)
        for i, lw in enumerate(L):
            self._attention(i, lw, ws, pos, slots, tok_row, block_tables, kv, block_size, fused, pdl=True)
            k.gemv(GEMV_PLAIN, lw["o"], ws.o, x_act=ws.attn, zero=ws.down, pdl=True)  # mlp_fused adds into down
            k.mlp_fused(lw["gate_up"], lw["down"], ws.o, ra, rb, lw["post_attn_norm"], lw["ffn_norm"], eps, ws.down,
                        pdl=True)
            if i + 1 < len(L):
                k.gemv(GEMV_ADD_NORM, L[i + 1]["qkv"], ws.qkv, src=ws.down, resid_in=rb, resid_out=ra,
                       w_post=lw["post_ffn_norm"], w_norm=L[i + 1]["attn_norm"], eps=eps, pdl=True)

    def forward(self, batch, kv: KVStorage):
        """Logits (rows of batch.logits_indices, vocab) for one engine step (workers/cupy/batch.StepBatch)."""
        meta = batch.meta
        n_query = np.diff(meta.query_start)
        n_rows = int(batch.logits_indices.shape[0])
        if (self.graph_sizes and n_query.size and np.all(n_query == 1) and n_rows == n_query.size
                and n_query.size <= self.graph_sizes[-1]):
            logits, kind = self._decode_graphs(kv, meta.block_size).run(batch), "graph"
        elif (self.verify_sizes and (self.mixed_graphs or n_rows == batch.num_tokens)
              and self._verify_graphs(kv, meta.block_size).fits(batch)):
            # a speculative verify step (every token wants logits) or a mixed one (prompt chunks beside decodes)
            logits, kind = self._verify.run(batch), "verify" if n_rows == batch.num_tokens else "mixed"
        else:
            logits, kind = self.forward_eager(batch, kv), "eager"
        self.step_kinds[kind] += 1
        self.last_logits = logits  # GpuSampler trusts last_chosen only for exactly these logits
        return logits

    def forward_eager(self, batch, kv: KVStorage):
        meta = batch.meta
        t, s = batch.num_tokens, int(batch.logits_indices.shape[0])
        ws = Workspace.allocate(self.cfg, t, s, self.act)
        tok_row = cp.asarray(np.repeat(np.arange(meta.seq_lens.size, dtype=np.int32), np.diff(meta.query_start)))
        slots, tables = device_kv_args(batch)
        self.run(ws, cp.asarray(batch.token_ids, cp.int32), cp.asarray(batch.positions, cp.int32),
                 slots, tok_row, tables, cp.asarray(batch.logits_indices, cp.int64), kv, meta.block_size)
        self.last_chosen = ws.chosen
        return ws.logits

    def capture_graphs(self, kv: KVStorage, block_size: int, verify: bool) -> None:
        """Capture the decode graphs (every size) and, with `verify` or mixed steps on, the verify graphs now: a
        worker does this at start, before it reports ready, so that the first request's step does not
        capture them all (seconds on the H200 at the h200 profile's 256-sequence batch)."""
        if self.graph_sizes:
            self._decode_graphs(kv, block_size)
        if (verify or self.mixed_graphs) and self.verify_sizes:
            self._verify_graphs(kv, block_size)

    def _verify_graphs(self, kv: KVStorage, block_size: int):
        from workers.cupy.gpu.verify import VerifyGraphs

        if self._verify is None or self._verify.kv is not kv:
            self._verify = VerifyGraphs(self, kv, block_size, self.verify_sizes, max(self.graph_sizes or (1,)),
                                        -(-self.max_model_len // block_size))
        return self._verify

    def _decode_graphs(self, kv: KVStorage, block_size: int):
        from workers.cupy.gpu.graphs import DecodeGraphs

        if self._graphs is None or self._graphs.kv is not kv:
            self._graphs = DecodeGraphs(self, kv, block_size, self.graph_sizes,
                                        -(-self.max_model_len // block_size))
        return self._graphs
