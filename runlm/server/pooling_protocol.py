"""Request bodies of the pooling routes: OpenAI's embeddings, vLLM's and llama.cpp's rerank and score."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

Int = StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class EmbeddingRequest(_Body):
    """OpenAI's fields, plus vLLM's truncate_prompt_tokens and normalize."""
    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1, le=1 << 20)
    user: StrictStr | None = None
    truncate_prompt_tokens: Int | None = Field(None, ge=-1, le=1 << 20)  # -1: to the model's maximum
    normalize: StrictBool | None = None


class TextDocument(_Body):
    text: StrictStr


class RerankRequest(_Body):
    """vLLM / Jina / Cohere rerank; llama.cpp's ``return_text`` and ``texts`` are accepted too."""
    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr | TextDocument] | None = None
    texts: list[StrictStr] | None = None
    top_n: Int | None = Field(None, ge=0)
    return_documents: StrictBool | None = None
    return_text: StrictBool | None = None

    def document_texts(self) -> list[str] | None:
        docs = self.documents if self.documents is not None else self.texts
        return None if docs is None else [d if isinstance(d, str) else d.text for d in docs]


class ScoreRequest(_Body):
    """vLLM's /score: text_1 against one or each of text_2."""
    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
