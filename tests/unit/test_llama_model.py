"""The engine's Llama model (NumPy path) against transformers' LlamaForCausalLM with the same random weights.

The weights go to the engine under their GGUF names with llama.cpp's q/k row permutation applied (the
converter's formula, written here), so the model's un-permuting and RoPE layout are checked too; GQA (4 query
heads on 2 KV heads), tied and untied heads, a mixed prefill step of two sequences then paged decode steps.
"""
from __future__ import annotations

import numpy as np
import pytest

from workers.cupy.batch import build_batch
from workers.cupy.kv_cache import BlockManager
from workers.cupy.llama import Llama, LlamaConfig
from workers.cupy.models import build_model, check_architecture
from workers.cupy.ops import Ops
from workers.cupy.sequence import Sequence
from workers.protocol.model import ModelInfo

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BS = 8
HP = {"llama.block_count": 2, "llama.embedding_length": 64, "llama.attention.head_count": 4,
      "llama.attention.head_count_kv": 2, "llama.feed_forward_length": 96, "llama.rope.freq_base": 50_000.0,
      "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": 16}
VOCAB = 128


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: halves layout -> adjacent rotation pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_and_weights(tied: bool):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=50_000.0, tie_word_embeddings=tied,
        max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1 so a missing or misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not tied:
        w["output.weight"] = sd["lm_head.weight"]
    names = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(2):
        p = f"model.layers.{i}."
        w[f"blk.{i}.attn_q.weight"] = llamacpp_permute(sd[p + "self_attn.q_proj.weight"], 4)
        w[f"blk.{i}.attn_k.weight"] = llamacpp_permute(sd[p + "self_attn.k_proj.weight"], 2)
        for hf, gg in names.items():
            w[f"blk.{i}.{gg}.weight"] = sd[p + hf + ".weight"]
    return model, w


def run_engine_model(model, prompts: list[list[int]], n_decode: int) -> list[list[np.ndarray]]:
    """Per sequence: logits after its prompt, then after each greedy decode token (paged KV, batched steps)."""
    kv, blocks = model.kv_storage(64, BS), BlockManager(64, BS)
    seqs = [Sequence(request_id=str(i), token_ids=list(p), max_tokens=n_decode) for i, p in enumerate(prompts)]
    for s in seqs:
        blocks.allocate(s, len(s.token_ids))
    logits = model.forward(build_batch([(s, len(s.token_ids)) for s in seqs], BS, np), kv)
    out = [[row] for row in logits]
    for _ in range(n_decode):
        for s, row in zip(seqs, logits):
            s.num_computed = len(s.token_ids)
            s.token_ids.append(int(np.argmax(row)))
            blocks.allocate(s, 1)
        logits = model.forward(build_batch([(s, 1) for s in seqs], BS, np), kv)
        for o, row in zip(out, logits):
            o.append(row)
    return out, [s.token_ids for s in seqs]


@pytest.mark.parametrize("tied", [True, False])
def test_matches_transformers(tied):
    ref, w = reference_and_weights(tied)
    info = ModelInfo(path="x", architecture="llama", context_length=512, vocab_size=VOCAB, bos_token_id=1,
                     eos_token_ids=(2,), add_bos=False, chat_template=None, hparams=HP)
    model = build_model(info, w, Ops(np))
    assert isinstance(model, Llama) and (model.head is model.embed) == tied
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, 21).tolist(), rng.integers(0, VOCAB, 5).tolist()]
    ours, full = run_engine_model(model, prompts, 3)
    for seq_logits, ids, prompt in zip(ours, full, prompts):
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].numpy()
        for j, row in enumerate(seq_logits):  # row j: logits at position len(prompt) - 1 + j
            np.testing.assert_allclose(row, theirs[len(prompt) - 1 + j], rtol=1e-4, atol=1e-4)


def test_config_from_header():
    cfg = LlamaConfig.from_hparams(HP, VOCAB)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_base, cfg.rope_scale) == (4, 2, 16, 50_000.0, 1.0)
    assert cfg.window is None and all(cfg.is_global(i) for i in range(cfg.n_layers))
    linear = LlamaConfig.from_hparams({**HP, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
                                      VOCAB)
    assert linear.rope_scale == 4.0
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_hparams({**HP, "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, VOCAB)
    with pytest.raises(ValueError, match="partial RoPE"):
        LlamaConfig.from_hparams({**HP, "llama.rope.dimension_count": 8}, VOCAB)


def test_rope_scaling_tables():
    """Linear scaling divides positions; rope_freqs factors divide each frequency (llama.cpp's semantics)."""
    ops, pos = Ops(np), np.arange(0, 4000, 37)
    c1, s1 = ops.rope_tables(pos, 10_000.0, 16, scale=4.0)
    c0, s0 = ops.rope_tables(pos / 4.0, 10_000.0, 16)
    np.testing.assert_allclose(c1, c0, atol=1e-6)
    np.testing.assert_allclose(s1, s0, atol=1e-6)
    factors = np.linspace(1.0, 8.0, 8)
    cf, _ = ops.rope_tables(pos, 10_000.0, 16, freq_factors=factors)
    inv = 1.0 / 10_000.0 ** (np.arange(0, 16, 2) / 16) / factors
    np.testing.assert_allclose(cf, np.cos(pos[:, None] * inv[None, :]), atol=1e-6)


def test_unsupported_architecture_names_it_and_llama_server():
    with pytest.raises(ValueError) as e:
        check_architecture("qwen2")
    msg = str(e.value)
    assert "'qwen2'" in msg and "gemma3" in msg and "llama" in msg and "llama-server" in msg


def test_serve_refuses_an_unsupported_architecture_before_starting(tmp_path, capsys):
    """`pulse serve --backend cupy` on a GGUF the engine cannot run: exit 2 naming it, before Ray starts."""
    import gguf

    from pulse.cli import main

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(512)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "▁a", "a"])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0])
    w.add_token_types([2, 3, 3, 1, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((5, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["serve", "--backend", "cupy", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "'qwen2'" in err and "gemma3, llama" in err and "llama-server" in err
