"""Ollama's routes, beside the others on the same engine, admission, telemetry and lifecycle: `/`,
`/api/version`, `/api/tags`, `/api/ps`, `/api/show`, `/api/chat`, `/api/generate`; `/api/embed` and
`/api/embeddings` (`embeddings.ollama_embed`: a model that embeds nothing is refused in Ollama's words); and
Ollama's model-management
routes (pull, push, create, copy, delete, blobs) refused in its error shape, since the server serves
the models it started with (`models.ModelSet`)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from stratum.server import ollama_api, structured
from stratum.server.body import read_request
from stratum.server.chat import ChatInput, Prompt, append_turn, build_prompt, tool_call, tool_result
from stratum.server.controls import asks_for_meta
from stratum.server.embeddings import ollama_embed, tasks_of
from stratum.server.errors import APIError, InvalidRequest, NotFound
from stratum.server.lifecycle import RequestLifecycle
from stratum.server.models import ServedModel, hold_model
from stratum.server.protocol.ollama import (OllamaChatRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                                            OllamaShowRequest)
from stratum.server.reasoning import Thinking
from stratum.server.runtime import Runtime
from stratum.server.sampling import defaults_of
from stratum.server.settings import ServerSettings


class NotImplementedHere(APIError):
    """An Ollama route this server does not serve (model management): 400, the client's request, since no
    request a client can send answers 5xx (a 501 would page an operator for a client's choice)."""

    status, type = 400, "invalid_request_error"


def ollama_thinking(think, model: str, reasons: bool) -> Thinking:
    """Ollama's `think`: true / false, or a level ("low", "medium", "high": `reasoning.EFFORT_BUDGETS`).

    Raises:
        InvalidRequest: thinking asked of a model that does not reason (Ollama's words).
    """
    if think is None:
        return Thinking()
    if not reasons:
        if think is False:
            return Thinking()
        raise InvalidRequest(f'"{model}" does not support thinking')
    if isinstance(think, bool):
        return Thinking(enabled=think)
    return Thinking.of_effort(think)


def _tools(req: OllamaChatRequest) -> list[dict] | None:
    return [{"name": t.function.name, "description": t.function.description or "",
             "parameters": t.function.parameters, "strict": False} for t in req.tools] if req.tools else None


def ollama_input(req: OllamaChatRequest, thinking: Thinking) -> ChatInput:
    """Ollama's messages as chat turns: an assistant's `thinking` as its `reasoning_content`, its
    `tool_calls` (arguments objects) as template calls with ids of their own; a `tool` turn answers
    the earliest unanswered call of the turn before it (to its `tool_name`, where it names one)."""
    messages: list[dict] = []
    names: dict[str, str] = {}
    open_calls: list[tuple[str, str]] = []  # (id, name) of the last assistant turn's calls not yet answered
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            match = next((c for c in open_calls if m.tool_name in (None, c[1])), None)
            call_id = m.tool_call_id or (match[0] if match else f"call_{i}")
            if match:
                open_calls.remove(match)
            result = tool_result(call_id, m.content or "", names)
            append_turn(messages, {**result, "name": m.tool_name or result["name"]})
            continue
        turn: dict = {"role": m.role, "content": m.content or ""}
        if m.thinking and m.role == "assistant":
            turn["reasoning_content"] = m.thinking
        if m.tool_calls:
            calls = [(c.id or f"call_{i}_{j}", c.function.name, c.function.arguments)
                     for j, c in enumerate(m.tool_calls)]
            names.update((call_id, name) for call_id, name, _ in calls)
            open_calls = [(call_id, name) for call_id, name, _ in calls]
            turn["tool_calls"] = [tool_call(*c) for c in calls]
        append_turn(messages, turn)
    system_text = "\n".join(m["content"] for m in messages if m["role"] == "system")
    return ChatInput(messages, _tools(req), False, system_text, output_schema=req.output_schema, thinking=thinking)


class _Served:
    """What Ollama's routes ask of the served models: their cards, the name check, bodies and sampling."""

    def __init__(self, rt: Runtime, settings: ServerSettings):
        self.rt, self.settings, self.models = rt, settings, rt.models
        self.cards: dict[str, ollama_api.ModelCard] = {}  # each model's, from its engine once it has loaded

    def card(self, served: ServedModel) -> ollama_api.ModelCard:
        """The model in Ollama's terms: from its engine's facts once it has loaded; before, from its files."""
        if served.engine is not None:
            self.cards[served.name] = ollama_api.ModelCard.of(served.name, served.engine.info)
        if served.name in self.cards:
            return self.cards[served.name]
        spec = served.spec
        facts = {"file_bytes": spec.weight_bytes, "modified_at": spec.modified_at,
                 "format": "gguf" if spec.path.endswith(".gguf") else "safetensors"}
        return ollama_api.ModelCard.of_file(served.name, spec.path, facts)

    def modified_at(self, c: ollama_api.ModelCard) -> str:
        return c.facts.get("modified_at") or self.settings.created_at

    @staticmethod
    def reasons(engine) -> bool:
        return engine.chat_template.thought_markers is not None

    def find(self, name: str) -> ServedModel:
        """A served name, with or without Ollama's tag (":latest"), or any name the model set serves.

        Raises:
            NotFound: 404 in Ollama's words.
        """
        base = name[:-len(":latest")] if name.endswith(":latest") else name
        try:
            return self.models.find(base)
        except NotFound:
            raise NotFound(f"model '{name}' not found") from None

    async def read(self, request: Request, model) -> tuple:
        """The body, validated, and the model it names, held (loaded) with the body's keep_alive."""
        req = await read_request(request, model, self.settings.max_body_bytes, self.settings.body_timeout_s)
        served = self.find(req.model)
        await hold_model(request, self.models, served.name, getattr(req, "keep_alive", None))
        return req, served

    @staticmethod
    def sampling_of(req, engine):
        o = req.options
        return defaults_of(engine).apply(max_tokens=o.max_tokens, temperature=o.temperature, top_p=o.top_p,
                                         top_k=o.top_k, stop=o.stop, seed=o.seed, logprobs=req.num_logprobs)

    @staticmethod
    def loaded(req, is_chat: bool) -> Response:
        body = ollama_api.loaded(req.model, is_chat, req.is_unload)
        if req.stream:
            return Response(ollama_api.to_json(body) + "\n", media_type=ollama_api.MEDIA_TYPE)
        return JSONResponse(body)


def ollama_routes(app: FastAPI, rt: Runtime, settings: ServerSettings) -> None:
    """Ollama's API on this app (docs/api.md, "Ollama's API")."""
    served = _Served(rt, settings)
    _catalogue_routes(app, served)
    _generation_routes(app, served)


def _catalogue_routes(app: FastAPI, served: _Served) -> None:
    """What is served, and what is not: the routes that generate nothing."""

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        return PlainTextResponse("Ollama is running")

    @app.api_route("/api/version", methods=["GET", "HEAD"])
    async def version():
        return {"version": ollama_api.OLLAMA_VERSION}

    @app.get("/api/tags")
    async def tags():
        cards = [served.card(m) for m in served.models.models.values()]
        return {"models": [c.tag(served.modified_at(c)) for c in cards]}

    @app.get("/api/ps")
    async def ps():
        return {"models": [served.card(m).running(m.expires_at) for m in served.models.loaded()]}

    @app.post("/api/show")
    async def show(request: Request):
        _, model = await served.read(request, OllamaShowRequest)
        engine = model.engine
        c, defaults, tasks = served.card(model), defaults_of(engine), tasks_of(engine)
        generates = ["completion", "tools"] + (["thinking"] if served.reasons(engine) else [])
        capabilities = (generates if "generate" in tasks else []) + (["embedding"] if "embed" in tasks else [])
        parameters = {"temperature": defaults.temperature, "top_p": defaults.top_p}
        return c.show(engine.chat_template.source, parameters, capabilities, served.modified_at(c))

    @app.post("/api/embed")
    @app.post("/api/embeddings")
    async def embed(request: Request):
        """/api/embed with {"model", "embeddings": [[...] per input], "total_duration", "load_duration",
        "prompt_eval_count"}, /api/embeddings (the older form, one `prompt`) with {"embedding": [...]}; a
        model without the capability is Ollama's refusal, 400 (and /api/show lists no "embedding")."""
        req, model = await served.read(request, OllamaEmbedRequest)
        is_legacy = request.url.path == "/api/embeddings"
        return await ollama_embed(served.rt, request, req, model.engine, is_legacy=is_legacy)

    # model management: the server serves the models it started with
    @app.post("/api/pull")
    @app.post("/api/push")
    @app.post("/api/create")
    @app.post("/api/copy")
    @app.delete("/api/delete")
    @app.api_route("/api/blobs/{digest}", methods=["POST", "HEAD"])
    async def manage(request: Request):
        what = request.url.path.removeprefix("/api/").split("/")[0]
        names = ", ".join(served.card(m).name for m in served.models.models.values())
        raise NotImplementedHere(f"{what} is not supported: this server serves the models it was started with "
                                 f"({names}); add one with `stratum serve --model` or --models-dir")


def _generation_routes(app: FastAPI, served: _Served) -> None:
    """/api/chat and /api/generate, through the request lifecycle every API shares."""
    rt = served.rt

    @app.post("/api/chat")
    async def chat(request: Request):
        req, model = await served.read(request, OllamaChatRequest)
        if not req.messages:
            return served.loaded(req, is_chat=True)
        chat = ollama_input(req, ollama_thinking(req.think, req.model, served.reasons(model.engine)))
        sampling = served.sampling_of(req, model.engine)
        max_tokens = req.options.max_tokens
        async with RequestLifecycle.admit(rt, request, "/api/chat", max_tokens, None) as lc:
            await lc.prepare(chat, sampling, default_max=max_tokens is None)
            await lc.submit()
            renderer = ollama_api.OllamaChat(lc.render_context(req.model), lc.wall0, asks_for_meta(request),
                                             lc.engine.tokenizer)
            return await lc.respond(renderer, req.stream, ollama_api.MEDIA_TYPE)

    @app.post("/api/generate")
    async def generate(request: Request):
        req, model = await served.read(request, OllamaGenerateRequest)
        if not req.prompt and not req.context:
            return served.loaded(req, is_chat=False)
        thinking = ollama_thinking(req.think, req.model, served.reasons(model.engine))
        sampling = served.sampling_of(req, model.engine)
        max_tokens = req.options.max_tokens
        async with RequestLifecycle.admit(rt, request, "/api/generate", max_tokens, None) as lc:
            raw, like = await _generate_prompt(lc.engine, rt.parse_thought, req, thinking)
            await lc.prepare(None if raw else _generate_chat(req, thinking), sampling, default_max=max_tokens is None,
                             raw=raw, like=like)
            await lc.submit()
            renderer = ollama_api.OllamaGenerate(lc.render_context(req.model), lc.wall0, asks_for_meta(request),
                                                 lc.engine.tokenizer)
            return await lc.respond(renderer, req.stream, ollama_api.MEDIA_TYPE)


def _generate_chat(req: OllamaGenerateRequest, thinking: Thinking) -> ChatInput:
    """/api/generate's prompt (and `system`) as a conversation of one user turn, through the chat template."""
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}]
    return ChatInput(messages, system_text=req.system or "", output_schema=req.output_schema, thinking=thinking)


async def _generate_prompt(engine, parse_thought: bool, req: OllamaGenerateRequest,
                           thinking: Thinking) -> tuple[list | None, Prompt | None]:
    """The prompt /api/generate queues when the chat path cannot build it alone: `raw` (the text as it
    is), or `context` (a previous answer's tokens, then this prompt rendered as Ollama does); (None,
    None) otherwise. The second is the prompt whose grammar and thought the raw prompt is read with.

    Raises:
        InvalidRequest: the format's schema cannot be enforced.
    """
    tokenizer, schema = engine.tokenizer, req.output_schema
    if req.raw:
        grammar = structured.json_grammar(schema, "format") if schema is not None else None
        like = Prompt([], grammar=grammar)
        if not req.context:
            return [req.prompt], like
        ids = await asyncio.to_thread(tokenizer.encode, req.prompt)
        return [[*req.context, *ids]], like
    if not req.context:
        return None, None
    chat = _generate_chat(req, thinking)
    prompt = await asyncio.to_thread(build_prompt, engine.chat_template, chat, parse_thought)
    ids = [*req.context, *prompt.token_ids]
    return [ids], replace(prompt, token_ids=ids)
