"""The routes that generate: each reads and checks its body, asks for its sampling over the server's
defaults, runs it as a `RequestLifecycle` and answers through its API's renderer."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from stratum.engine.faults import Faults
from stratum.server import anthropic_api, openai_api, responses_api, responses_chat
from stratum.server.auth import owner_of
from stratum.server.body import read_request
from stratum.server.chat import anthropic_input, build_prompt, openai_input
from stratum.server.counting import TokenCounter
from stratum.server.errors import InvalidRequest
from stratum.server.lifecycle import RequestLifecycle
from stratum.server.models import hold_model
from stratum.server.protocol import (ChatCompletionRequest, CompletionRequest, InputTokensRequest, MessagesRequest,
                                     ResponsesRequest)
from stratum.server.runtime import Runtime
from stratum.server.sampling import OpenAILimit, check_output_limit, defaults_of
from stratum.server.settings import ServerSettings

# Choices one request may ask for: prompts x n on /v1/completions.
MAX_CHOICES = 64


def generation_routes(app: FastAPI, rt: Runtime, settings: ServerSettings, counter: TokenCounter) -> None:
    """/v1/messages, /v1/chat/completions, /v1/completions and /v1/responses (its token count under
    `counter`'s admission)."""
    faults = Faults.from_env()

    async def read(request: Request, model):
        """The body, validated, and the engine of the model it names, held until its response is sent."""
        req = await read_request(request, model, settings.max_body_bytes, settings.body_timeout_s)
        if faults.is_route_error:
            raise RuntimeError("injected route error (STRATUM_FAULT_INJECT=route)")
        served = await hold_model(request, rt.models, req.model)
        return req, served.engine

    @app.post("/v1/messages")
    async def messages(request: Request):
        req, engine = await read(request, MessagesRequest)
        check_output_limit(req.max_tokens, engine.config, req.model)
        chat = anthropic_input(req, rt.thought_signer(engine))
        sampling = defaults_of(engine).apply(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, stop=req.stop_sequences, seed=req.seed, ignore_eos=req.ignore_eos)
        user_id = req.metadata.user_id if req.metadata else None
        async with RequestLifecycle.admit(rt, request, "/v1/messages", req.max_tokens, user_id) as lc:
            await lc.prepare(chat, sampling, fit_context=True)
            await lc.submit()
            return await lc.respond(anthropic_api.Messages(lc.render_context(req.model)), req.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, engine = await read(request, ChatCompletionRequest)
        chat = openai_input(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        limit = OpenAILimit("messages", "max_completion_tokens" if req.max_completion_tokens is not None else
                            "max_tokens" if req.max_tokens is not None else None)
        sampling = defaults_of(engine).apply(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                             top_k=req.top_k,
                                  stop=req.stop, seed=req.seed, ignore_eos=req.ignore_eos,
                                  logprobs=req.top_logprobs or 0 if req.logprobs else None)
        async with RequestLifecycle.admit(rt, request, "/v1/chat/completions", max_tokens, req.user) as lc:
            await lc.prepare(chat, sampling, default_max=max_tokens is None, n=req.n, openai_limit=limit)
            await lc.submit()
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            renderer = openai_api.Chat(lc.render_context(req.model), include_usage, lc.engine.tokenizer)
            return await lc.respond(renderer, req.stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, engine = await read(request, CompletionRequest)
        prompts = req.prompt if isinstance(req.prompt, list) and not isinstance(req.prompt[0], int) else [req.prompt]
        if len(prompts) * req.n > MAX_CHOICES:
            raise InvalidRequest(f"{len(prompts)} prompts x n {req.n} exceeds {MAX_CHOICES} choices per request")
        sampling = defaults_of(engine).apply(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                             top_k=req.top_k, stop=req.stop, seed=req.seed, ignore_eos=req.ignore_eos,
                                             logprobs=req.logprobs,
                                             # echo with logprobs scores the prompt too (as evaluation harnesses ask)
                                             prompt_logprobs=req.logprobs if req.echo else None)
        async with RequestLifecycle.admit(rt, request, "/v1/completions", req.max_tokens, req.user) as lc:
            await lc.prepare(None, sampling, default_max=req.max_tokens is None, n=req.n, raw=prompts,
                             openai_limit=OpenAILimit("prompt", None if req.max_tokens is None else "max_tokens"))
            await lc.submit()
            echoes = [(p if isinstance(p, str) else await asyncio.to_thread(lc.engine.tokenizer.decode, p))
                      if req.echo else "" for p in prompts]
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            renderer = openai_api.Text(lc.render_context(req.model), include_usage, lc.engine.tokenizer, echoes)
            return await lc.respond(renderer, req.stream)

    responses_routes(app, rt, settings, read, counter)


def responses_routes(app: FastAPI, rt: Runtime, settings: ServerSettings, read, counter: TokenCounter) -> None:
    """/v1/responses: create (a stored response's conversation continued with previous_response_id),
    retrieve, delete, and list a stored response's input items."""
    store, keyed = rt.responses, bool(settings.api_keys)

    @app.post("/v1/responses")
    async def responses(request: Request):
        req, engine = await read(request, ResponsesRequest)
        owner = owner_of(request, keyed)
        asked = responses_chat.as_chat(req, store, owner)
        sampling = defaults_of(engine).apply(max_tokens=req.max_output_tokens, temperature=req.temperature,
                                             top_p=req.top_p, seed=req.seed, ignore_eos=req.ignore_eos)
        names = {s.model_name: (s.namespace, s.name, s.is_custom) for s in asked.offered}
        keep = ((lambda body: store.put(owner, body, asked.stored_input, req.previous_response_id))
                if req.is_stored else None)
        async with RequestLifecycle.admit(rt, request, "/v1/responses", req.max_output_tokens,
                                          req.safety_identifier or req.user) as lc:
            limit = OpenAILimit("input", None if req.max_output_tokens is None else "max_output_tokens")
            await lc.prepare(asked.chat, sampling, default_max=req.max_output_tokens is None, openai_limit=limit)
            await lc.submit()
            shell = responses_api.ResponseShell(req, sampling.temperature, sampling.top_p)
            renderer = responses_api.Responses(lc.render_context(req.model), shell, names, keep)
            return await lc.respond(renderer, req.stream)

    @app.post("/v1/responses/input_tokens")
    async def count_input_tokens(request: Request):
        req = await read_request(request, InputTokensRequest, settings.max_body_bytes, settings.body_timeout_s)
        served = await hold_model(request, rt.models, req.model if req.model is not None else rt.models.default.name)
        chat = responses_chat.as_chat(req, store, owner_of(request, keyed)).chat
        async with counter.admit(request, "/v1/responses/input_tokens", request.state.num_body_bytes) as counting:
            prompt = await counting.count(build_prompt, served.engine.chat_template, chat, rt.parse_thought)
        return {"object": "response.input_tokens", "input_tokens": len(prompt.token_ids)}

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str):
        return store.get(owner_of(request, keyed), response_id).body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        store.delete(owner_of(request, keyed), response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str, limit: int = 20, order: str = "desc",
                               after: str | None = None):
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            raise InvalidRequest("limit must be 1 to 100 and order asc or desc")
        items = store.input_of(owner_of(request, keyed), response_id)
        return responses_api.item_page(items if order == "asc" else items[::-1], limit, after)
