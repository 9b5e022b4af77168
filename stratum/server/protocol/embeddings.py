"""The bodies of the embedding and rerank routes: OpenAI's /v1/embeddings (`EmbeddingRequest`) and the
rerank shape llama-server, vLLM, Cohere and Jina share (`RerankRequest`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stratum.server.protocol.chat_completions import TokenId
from stratum.server.protocol.common import MAX_COUNT, Loose

# OpenAI's bound on the inputs of one embeddings request; the same for a rerank's documents
MAX_INPUTS = 2048


class EmbeddingRequest(Loose):
    """OpenAI's: `input` a string, strings, token ids or lists of token ids; `encoding_format` float or
    base64 (little-endian float32, as the openai SDK decodes it); `dimensions` only as the model's own."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(max_length=2**20)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    user: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _rules(self):
        inputs = self.inputs
        if not inputs:
            raise ValueError("input must not be empty")
        if len(inputs) > MAX_INPUTS:
            raise ValueError(f"input holds {len(inputs)} items: at most {MAX_INPUTS} per request")
        if any(len(i) == 0 for i in inputs):
            raise ValueError("input must not hold an empty string or an empty list of tokens")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """One entry per vector asked for: a text or its token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    text: str


class RerankRequest(Loose):
    """A query and documents (strings or {"text": ...}); the `top_n` best returned, with their text
    unless `return_documents` is false. `model` may be left out (llama-server's clients do)."""

    model: str | None = Field(default=None, min_length=1, max_length=256)
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    return_documents: bool = True

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
