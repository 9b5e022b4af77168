"""Embeddings and rerank on the served model: OpenAI's `/v1/embeddings`, the rerank routes llama-server,
vLLM, Cohere and Jina clients call (`/v1/rerank`, `/rerank`, `/v2/rerank`), and Ollama's `/api/embed` and
`/api/embeddings` (`ollama_embed`, from `ollama_routes`). Each input is one prefill-only engine request
under the same admission, lifecycle and cost telemetry as generation (`RequestLifecycle`); the engine
pools it (`engine.encoder` for an encoder, `--pooling` for a decoder) and answers with its vector.
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from stratum.engine.outputs import RequestOutput
from stratum.engine.request import CachePolicy
from stratum.engine.sampling_params import SamplingParams
from stratum.server.body import read_request
from stratum.server.chat import Prompt
from stratum.server.controls import controls_of
from stratum.server.counting import TokenCounter
from stratum.server.errors import InvalidRequest
from stratum.server.lifecycle import Prepared, RequestLifecycle
from stratum.server.models import hold_model
from stratum.server.openapi import describe_bodies
from stratum.server.protocol.embeddings import EmbeddingRequest, RerankRequest
from stratum.server.runtime import Runtime
from stratum.server.sampling import CONTEXT_LENGTH_EXCEEDED
from stratum.server.settings import ServerSettings
from stratum.server.usage import merge

_PREFILL_ONLY = SamplingParams(max_tokens=0, temperature=0.0)


def tasks_of(engine) -> tuple[str, ...]:
    """What the served model does ("generate", "embed", "score": `EngineInfo.tasks`)."""
    return tuple(engine.info.tasks)


def _require(engine, task: str, what: str, model: str) -> None:
    """Raises InvalidRequest (400): the model does not serve `task` (a chat model served without
    `--pooling`, an embedding model asked to rerank)."""
    if task not in tasks_of(engine):
        hint = " (serve it with --pooling mean or last)" if task == "embed" and "generate" in tasks_of(engine) else ""
        raise InvalidRequest(f"the model {model!r} does not support {what}{hint}", param="model",
                             code="model_not_supported")


def _check_length(engine, ids: list[int], field: str) -> None:
    """OpenAI's context rule for an input (a prompt as long as the context is served: nothing is generated).

    Raises:
        InvalidRequest: 400 with code context_length_exceeded.
    """
    size = engine.config.max_model_len
    if len(ids) > size:
        raise InvalidRequest(f"This model's maximum context length is {size} tokens. However, your {field} resulted "
                             f"in {len(ids)} tokens. Please reduce the length of the {field}.", param=field,
                             code=CONTEXT_LENGTH_EXCEEDED)


def _tokenize(engine, texts: list[str | list[int]]) -> list[list[int]]:
    """Each input's ids: an encoder's with its [CLS] ... [SEP] (its tokenizer's template), a decoder's
    with BOS where its tokenizer adds it; special-token strings read as plain text. Ids pass as given."""
    tok = engine.tokenizer
    is_encoder = "generate" not in tasks_of(engine)
    strings = [t for t in texts if isinstance(t, str)]
    if is_encoder:
        encoded = iter(e.ids for e in tok.plain.encode_batch(strings, add_special_tokens=True))
    else:
        encoded = iter(tok.encode_prompt(t) for t in strings)
    return [next(encoded) if isinstance(t, str) else list(t) for t in texts]


async def embed_all(lc: RequestLifecycle, prompts: list[list[int]], task: str = "embed"
                    ) -> tuple[list[list[float]], RequestOutput]:
    """Run each prompt as one prefill-only request of the lifecycle's group; its reservation holds every
    prompt token (no output). Returns (each prompt's vector, in order; the outputs merged for the bill)."""
    lc.controls = controls_of(lc.request, "", lc.is_batch)
    lc.reservation.reserve(sum(map(len, prompts)), 0)
    lc.prepared = Prepared(Prompt(prompts[0]), tuple(prompts), "", _PREFILL_ONLY, 1, CachePolicy(read=False), (), 0,
                           False, None, task=task)
    await lc.submit()
    outs = await lc.collect()
    return [o.embedding for o in outs], merge(outs, 1)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the float32 values' little-endian bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def embedding_routes(app: FastAPI, rt: Runtime, settings: ServerSettings, counter: TokenCounter) -> None:
    """/v1/embeddings and the rerank routes (docs/api.md, "Embeddings and rerank")."""
    describe_bodies(app, {"/v1/embeddings": EmbeddingRequest, "/v1/rerank": RerankRequest, "/rerank": RerankRequest,
                          "/v2/rerank": RerankRequest})

    async def read(request: Request, model):
        """The body, validated, and the model it names (rerank's is optional: the default), held."""
        req = await read_request(request, model, settings.max_body_bytes, settings.body_timeout_s)
        await hold_model(request, rt.models, req.model if req.model is not None else rt.models.default.name)
        return req

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = await read(request, EmbeddingRequest)
        async with RequestLifecycle.admit(rt, request, "/v1/embeddings", 0, req.user) as lc:
            engine = lc.engine
            _require(engine, "embed", "embeddings", req.model)
            size = engine.info.embedding_size
            if req.dimensions is not None and req.dimensions != size:
                # the served models are not trained to keep their meaning in a prefix of the vector
                # (Matryoshka training): only the model's own size is served
                raise InvalidRequest(f"this model does not support specifying dimensions other than its own ({size})",
                                     param="dimensions")
            prompts = await asyncio.to_thread(_tokenize, engine, req.inputs)
            for ids in prompts:
                _check_length(engine, ids, "input")
            vectors, final = await embed_all(lc, prompts)
            report = lc.finish(final)
        n = sum(map(len, prompts))
        body = {"object": "list", "model": req.model,
                "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": n, "total_tokens": n}}
        return JSONResponse(body, headers=report.headers)

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: Request):
        req = await read(request, RerankRequest)
        path = request.url.path
        model = req.model or rt.models.default.name
        async with RequestLifecycle.admit(rt, request, path, 0, None) as lc:
            engine = lc.engine
            _require(engine, "score", "rerank", model)
            texts = req.texts
            plain = engine.tokenizer.plain
            pairs = await asyncio.to_thread(
                lambda: [e.ids for e in plain.encode_batch([(req.query, t) for t in texts], add_special_tokens=True)])
            for ids in pairs:
                _check_length(engine, ids, "query and document")
            scores, final = await embed_all(lc, pairs, task="score")
            report = lc.finish(final)
        ranked = sorted(range(len(texts)), key=lambda i: -scores[i][0])[: req.top_n]
        n = sum(map(len, pairs))
        results = [{"index": i, "relevance_score": scores[i][0],
                    **({"document": {"text": texts[i]}} if req.return_documents else {})} for i in ranked]
        body = {"id": lc.request_id, "object": "list", "model": model, "results": results,
                "usage": {"prompt_tokens": n, "total_tokens": n},
                "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": n}}}
        return JSONResponse(body, headers=report.headers)


async def ollama_embed(rt: Runtime, request: Request, req, engine, is_legacy: bool) -> JSONResponse:
    """Ollama's /api/embed ({"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"})
    or /api/embeddings, its older form (one `prompt` -> {"embedding"}). An input longer than the context
    is cut to it where `truncate` (Ollama's default), else refused.

    Raises:
        InvalidRequest: the model embeds nothing (Ollama's words), no input, or too long with truncate false.
    """
    t0 = time.perf_counter()
    if "embed" not in tasks_of(engine):
        raise InvalidRequest(f'"{req.model}" does not support embeddings')
    texts = [req.prompt] if is_legacy else [req.input] if isinstance(req.input, str) else list(req.input or [])
    if not texts or any(t is None or t == "" for t in texts):
        raise InvalidRequest("input is empty" if not is_legacy else "prompt is empty")
    async with RequestLifecycle.admit(rt, request, request.url.path, 0, None) as lc:
        engine = lc.engine
        prompts = await asyncio.to_thread(_tokenize, engine, texts)
        size, is_encoder = engine.config.max_model_len, "generate" not in tasks_of(engine)
        for i, ids in enumerate(prompts):
            if len(ids) > size:
                if not req.truncate:
                    raise InvalidRequest("input exceeds maximum context length")
                prompts[i] = ids[: size - 1] + ids[-1:] if is_encoder else ids[:size]  # an encoder keeps its [SEP]
        vectors, final = await embed_all(lc, prompts)
        report = lc.finish(final)
    if is_legacy:
        return JSONResponse({"embedding": vectors[0]}, headers=report.headers)
    body = {"model": req.model, "embeddings": vectors, "total_duration": int((time.perf_counter() - t0) * 1e9),
            "load_duration": 0, "prompt_eval_count": sum(map(len, prompts))}
    return JSONResponse(body, headers=report.headers)
