"""The models one gateway serves: per model its prompt builder, its token texts and its context window.

    catalog = ModelCatalog.build(config)          # one ServedModel per config.models entry
    model = catalog.get(req.model)                # by name or alias; 404 model_not_found names what is served
    model.builder.chat(messages), model.context_length, model.token_text(id)

Each model is held by workers of its own (WorkerInfo.model); the dispatcher sends a request only to its
model's workers, so a prefix cache hit can only come from a worker holding the same model.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.prompt import PromptBuilder
from policy.config import ModelConfig, PulseConfig


@dataclass
class ServedModel:
    name: str
    builder: PromptBuilder
    token_text: Callable[[int], str]  # token id -> its text, for logprobs
    context_length: int  # lowered to the smallest its workers report once they are known
    aliases: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, model: ModelConfig) -> "ServedModel":
        from workers.protocol.model import load_model_info, load_tokenizer

        info = load_model_info(model.path)
        tok = load_tokenizer(model.path)
        builder = PromptBuilder(tok, architecture=info.architecture, bos_token_id=info.bos_token_id,
                                add_bos=info.add_bos, template=model.chat_template or info.chat_template)

        def token_text(token_id: int) -> str:
            return tok.decode([token_id], skip_special_tokens=False)

        return cls(model.name, builder, token_text, model.context_length or info.context_length, list(model.aliases))


class ModelCatalog:
    """Served models by every id that names them (name and aliases), in config order."""

    def __init__(self, models: Iterable[ServedModel]):
        self.models = list(models)
        self._by_id = {model_id: m for m in self.models for model_id in (m.name, *m.aliases)}

    @classmethod
    def build(cls, config: PulseConfig) -> "ModelCatalog":
        return cls(ServedModel.load(m) for m in config.models)

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def get(self, model_id: str) -> ServedModel:
        m = self._by_id.get(model_id)
        if m is None:
            served = ", ".join(f"`{x.name}`" for x in self.models)
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return m

    def fit_to_workers(self, workers: Iterable) -> None:
        """Each model's context window: the smallest its workers serve (WorkerInfo.context_length)."""
        workers = list(workers)
        for m in self.models:
            lengths = [w.info.context_length for w in workers if w.info.context_length and w.info.model in ("", m.name)]
            if lengths:
                m.context_length = min(lengths)
