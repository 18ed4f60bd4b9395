"""The HTTP surface: OpenAI + Anthropic compatible routes over one engine. Handlers only route;
mapping lives in openai_request/openai_response/anthropic_map, generation in the engine.

FastAPI/Starlette: routing, SSE streaming and disconnect handling are what it does well; bodies
are parsed by hand so every invalid one becomes our own 400 (never a 422).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from mtplx import chat_template
from mtplx.bank.watch import BankWatch
from mtplx.engine.sampling import SamplingParams
from mtplx.events import Failed, Finished, PrefillProgress, Restored, Tokens
from mtplx.server import (anthropic_map, cache_diagnostics, completion_prompt, context_edits, cors, input_items,
                          openai_response, output_format, responses, tokenizer_api)
from mtplx.server.api_error import ApiError, bad_request
from mtplx.server import event_watch
from mtplx.server.encode_cache import EncodeCache
from mtplx.server import guard
from mtplx.server.message_threads import MessageThreads
from mtplx.server.metrics import Metrics
from mtplx.server.request_body import read_body
from mtplx.server.response_store import ResponseStore
from mtplx.home import home_path
from mtplx.server.context import window_of
from mtplx.server.recorder import Recorder
from mtplx.server.signature import Signer
from mtplx.server.tool_choice import ToolRules
from mtplx.server.openai_request import ChatCall, choices, parse_chat, parse_json, sampling_from, stream_flag
from mtplx.server.turns import (Choices, budget_headers, encode, encoded, events, render_call, session_from, submit,
                                submit_choices)

DEFAULTS = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=1024)


def _sse(data) -> bytes:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


def create_app(engine, model_name: str, api_key: str | None = None, defaults: SamplingParams = DEFAULTS,
               cors_origins: tuple[str, ...] = ()) -> FastAPI:
    app = FastAPI(title="mtplx", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = engine.checkpoint.tokenizer
    # The checkpoint's generation_config.json sampling stands in for ours; a request's own values still win.
    generation = getattr(engine.checkpoint, "generation", None)
    defaults = generation.defaults(defaults) if generation is not None else defaults
    cache = EncodeCache(engine.checkpoint.identity, chat_template.identity(tokenizer))
    metrics = Metrics(getattr(engine, "layout", None))
    engine.listeners.append(metrics.observe)
    app.state.metrics, app.state.encode_cache = metrics, cache
    app.state.watchers = event_watch.Watchers()  # GET /v1/mtplx/events streams, ended at shutdown
    recorder = Recorder.from_env()
    rules = ToolRules(tokenizer, engine.eos_ids, getattr(engine.checkpoint, "tool_format", None))
    signer = Signer(lambda: home_path("signing.key"))
    response_store = ResponseStore(home_path("responses.db"))  # survives a restart
    threads = MessageThreads(home_path("threads.db"))  # Anthropic's message threads, the same way
    diagnostics = cache_diagnostics.CacheDiagnostics()  # what each recent request's prompt was made of

    def limit() -> int:
        return engine.context_window

    def prompt_size(body: dict) -> int:
        """An Anthropic request's prompt tokens (context edits measure what they clear with it)."""
        call = anthropic_map.parse_messages_call(body, defaults, limit(), require_max_tokens=False, signer=signer)
        return len(encode(engine, cache, call, "count_tokens", json.dumps(body, ensure_ascii=False).encode()))

    # -- errors -----------------------------------------------------------------------------
    def shaped(request: Request, err: ApiError) -> JSONResponse:
        return guard.shaped(request.url.path, err)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return shaped(request, exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error", 401: "authentication_error"}.get(exc.status_code, "invalid_request_error")
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return shaped(request, ApiError(exc.status_code, message, None, kind))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return shaped(request, bad_request("invalid request"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # Only what escapes Guard (which answers the rest itself) reaches this one.
        return guard.internal_error(request.url.path, exc)

    app.add_middleware(guard.Guard, api_key=api_key, metrics=metrics, router=app.router)
    cors.install(app, cors_origins)  # outermost: a browser's preflight is answered before the key check

    async def body_of(request: Request) -> tuple[bytes, dict]:
        raw = await read_body(request)
        recorder.record(request.method, request.url.path, request.headers, raw)
        return raw, parse_json(raw)

    # -- plain routes -----------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what some supervisors probe with
    async def health():
        # 503 once the engine cannot serve, so a supervisor or load balancer sees it.
        report = {"status": "ok" if engine.alive else "unavailable", "model": model_name, **engine.health()}
        # Which compute path runs the model ('cpu fp32 + mkl', 'metal', ...; see mtplx/fast_path.py).
        report["compute"] = getattr(getattr(engine, "checkpoint", None), "extras", {}).get("compute")
        return JSONResponse(report, status_code=200 if engine.alive else 503)

    def model_card() -> dict:
        window = window_of(engine)  # context_window (+ max_model_len, as vLLM names it) is what a request may use
        # OpenAI's fields and Anthropic's (type, display_name, created_at), so either SDK's models.list() reads it
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "mtplx",
                "type": "model", "display_name": model_name, "created_at": "1970-01-01T00:00:00Z",
                "lifecycle": "active", "max_input_tokens": window.tokens,
                **window.describe(), "max_model_len": window.tokens,
                # whether it speculates, and if not, why (one sentence)
                "mtp": engine.has_mtp, "mtp_notice": engine.checkpoint.mtp_notice}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    @app.api_route("/models", methods=["GET", "HEAD"], include_in_schema=False)
    async def models():
        return {"object": "list", "data": [model_card()], "has_more": False, "first_id": model_name, "last_id": model_name}

    # OpenAI's "retrieve model": some clients check the configured model this way before a turn.
    @app.get("/v1/models/{model_id:path}")
    @app.get("/models/{model_id:path}", include_in_schema=False)
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves {model_name!r}",
                           "model", "invalid_request_error", "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/mtplx/events")
    async def engine_events(request: Request):
        return StreamingResponse(app.state.watchers.watch(engine), media_type="text/event-stream")

    bank_watch = BankWatch(engine)  # the bank's summary as of its last event, readable mid-request
    engine.listeners.append(bank_watch)

    @app.get("/v1/mtplx/bank")
    async def bank_entries():
        return {"entries": await asyncio.to_thread(bank_watch.latest)}

    # -- OpenAI -----------------------------------------------------------------------------
    # Each OpenAI route also answers without its /v1 prefix, as mlx_lm.server's does: a client
    # configured with the bare server URL (an OpenAI SDK base_url of http://host:port) appends
    # the route to it directly.
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)
    async def chat(request: Request):
        raw, body = await body_of(request)
        call = parse_chat(body, defaults, limit())
        prompt = await encoded(engine, cache, call, "chat", raw, rules)
        logprobs = call.sampling.logprobs is not None
        if call.n > 1:
            return await _chosen(request, call, submit_choices(engine, call, prompt, "api", session_from(
                request.headers, body, call), raw, rules), logprobs)
        sub = submit(engine, call, prompt, "api", session_from(request.headers, body, call), raw, rules)
        if not call.stream:  # the engine split the reply in the model's tool-call format (Finished.pieces)
            return await _whole(sub, lambda fin: openai_response.completion(model_name, fin, logprobs), request,
                                budget_headers(call, sub))
        chunks = openai_response.ChatStream(model_name, logprobs)
        return _streamed(request, sub, _openai_sse(sub, chunks, call.include_usage, chunks.first()),
                         budget_headers(call, sub))

    async def _chosen(request: Request, call, subs: list, logprobs: bool):
        """Chat's `n` choices: one completion whose choices are the turns, in order."""
        group, headers = Choices(subs), budget_headers(call, subs[0])
        if not call.stream:
            return await _whole(group, lambda fins: openai_response.completions(model_name, fins, logprobs), request,
                                headers)
        first = openai_response.ChatStream(model_name, logprobs)
        streams = [first] + [openai_response.ChatStream(model_name, logprobs, i, first) for i in range(1, len(subs))]
        return _streamed(request, group, _choices_sse(subs, streams, call.include_usage, [s.first() for s in streams]),
                         headers)

    @app.post("/v1/completions")
    @app.post("/completions", include_in_schema=False)
    async def completions(request: Request):
        raw, body = await body_of(request)
        stream = stream_flag(body)
        if body.get("stream_options") is not None and not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        # max_tokens 0: the prompt computed and nothing generated (scored, with echo and logprobs,
        # as older evaluation tools ask; or the bank prewarmed), as OpenAI's legacy API allowed
        nothing = body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
        sampled = sampling_from({**body, "max_tokens": 1} if nothing else body, defaults, limit(), several=True)
        call = ChatCall([], None, sampled, stream, include_usage, schema=output_format.from_openai(body.get("response_format")),
                        n=choices(body), prefill_only=nothing)
        givens = completion_prompt.parse(body, len(tokenizer), call.n)
        if givens[0].echo and call.sampling.logprobs is not None:  # the prompt scored as well
            call = replace(call, prompt_logprobs=call.sampling.logprobs)
        await asyncio.to_thread(output_format.compile_call, engine, call)
        prompts = await asyncio.to_thread(lambda: [g.tokens(tokenizer) for g in givens])
        logprobs, echoes = call.sampling.logprobs is not None, [g.echoed(tokenizer) for g in givens]
        if len(prompts) > 1 or call.n > 1:
            # choice p * n + j: prompt p's choice j, drawn as a lone request for that prompt would
            session = session_from(request.headers)
            subs = [sub for p, prompt in enumerate(prompts)
                    for sub in submit_choices(engine, call, prompt, "api", session if p == 0 else None, raw, None)]
            echoes = [echo for echo in echoes for _ in range(call.n)]
            headers = budget_headers(call, subs[0])
            if not stream:
                return await _whole(Choices(subs), lambda fins: openai_response.text_completions(
                    model_name, fins, logprobs, echoes, call.n), request, headers)
            first = openai_response.TextCompletionStream(model_name, logprobs)
            streams = [first] + [openai_response.TextCompletionStream(model_name, logprobs, i, first)
                                 for i in range(1, len(subs))]
            return _streamed(request, Choices(subs), _choices_sse(subs, streams, include_usage,
                                                                  [s.first(e) for s, e in zip(streams, echoes)], call.n),
                             headers)
        sub = submit(engine, call, prompts[0], "api", session_from(request.headers), raw)
        if not stream:
            return await _whole(sub, lambda fin: openai_response.text_completion(model_name, fin, logprobs, echoes[0]),
                                request, budget_headers(call, sub))
        chunks = openai_response.TextCompletionStream(model_name, logprobs)
        return _streamed(request, sub, _openai_sse(sub, chunks, include_usage, chunks.first(echoes[0])),
                         budget_headers(call, sub))

    # -- OpenAI Responses (Codex) -----------------------------------------------------------
    @app.post("/v1/responses")
    @app.post("/responses", include_in_schema=False)
    async def responses_route(request: Request):
        raw, body = await body_of(request)
        call = responses.parse_response_call(body, defaults, limit(), response_store, signer)
        prompt = await encoded(engine, cache, call, "responses", raw, rules)
        sub = submit(engine, call, prompt, "api", session_from(request.headers, body, call), raw, rules)
        built = responses.ResponseStream(model_name, body, signer, logprobs=call.sampling.logprobs is not None)
        compared_with = responses.cache_options(body).get("comparison_response_id")

        def diagnose(fin):  # before the response is built: it carries the verdict (a worker thread)
            if body.get("prompt_cache_options") is None:
                return
            fingerprint = cache_diagnostics.openai_fingerprint(body, call.messages, len(prompt))
            if compared_with is not None:
                built.diagnostics = cache_diagnostics.openai_diagnostics(
                    diagnostics.compare(compared_with, fingerprint, fin.cached_tokens, "input_changed"))
            diagnostics.remember(built.id, fingerprint)

        def keep(fin):  # what a follow-up naming this response renders as its history, and the response
            if body.get("store") is not False:
                response_store.put(built.id, call.messages + responses.output_messages(built.output, built.names),
                                   built.response("completed", fin), input_items.of_request(body))

        if not call.stream:
            return await _whole(sub, lambda fin: (diagnose(fin), built.whole(fin), keep(fin))[1], request,
                                budget_headers(call, sub))

        async def stream():
            for name, data in built.start():
                yield event_watch.sse(name, data)
            async for event in events(sub):
                if isinstance(event, PrefillProgress):
                    yield b": prefill\n\n"
                elif isinstance(event, Tokens):
                    for name, data in built.tokens(event):
                        yield event_watch.sse(name, data)
                elif isinstance(event, Finished):
                    await asyncio.to_thread(diagnose, event)
                    finish = built.finish(event)
                    # stored before the client sees response.completed: its follow-up may name it at once
                    await asyncio.to_thread(keep, event)
                    for name, data in finish:
                        yield event_watch.sse(name, data)
                elif isinstance(event, Failed):
                    failure = _failure(event)
                    yield event_watch.sse("response.failed", {"type": "response.failed", "response": {
                        **built.response("failed"), "error": {"code": failure.type, "message": failure.message}}})

        return _streamed(request, sub, stream(), budget_headers(call, sub))

    @app.post("/v1/responses/input_tokens")
    @app.post("/responses/input_tokens", include_in_schema=False)
    async def response_input_tokens(request: Request):
        """The prompt's size as /v1/responses would render it (the SDK's responses.input_tokens.count)."""
        raw, body = await body_of(request)
        call = responses.parse_response_call(body, defaults, limit(), response_store, signer)
        return {"object": "response.input_tokens", "input_tokens": len(await encoded(engine, cache, call, "input_tokens", raw))}

    @app.get("/v1/responses/{response_id}")
    @app.get("/responses/{response_id}", include_in_schema=False)
    async def response_get(response_id: str):
        found = await asyncio.to_thread(response_store.response, response_id)
        if found is None:
            raise _no_response(response_id)
        return JSONResponse(found)

    @app.get("/v1/responses/{response_id}/input_items")
    @app.get("/responses/{response_id}/input_items", include_in_schema=False)
    async def response_input_items(response_id: str, request: Request):
        found = await asyncio.to_thread(response_store.inputs, response_id)
        if found is None:
            raise _no_response(response_id)
        return JSONResponse(input_items.page(found, request.query_params))

    @app.delete("/v1/responses/{response_id}")
    @app.delete("/responses/{response_id}", include_in_schema=False)
    async def response_delete(response_id: str):
        if not await asyncio.to_thread(response_store.delete, response_id):
            raise _no_response(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    # -- Anthropic --------------------------------------------------------------------------
    @app.post("/v1/messages")
    async def messages(request: Request):
        raw, body = await body_of(request)
        body, threaded = await asyncio.to_thread(threads.expand, body)
        whole = body  # a thread keeps the conversation as sent: edits apply to each request's prompt
        body, applied = await asyncio.to_thread(context_edits.apply, body, prompt_size)
        if threaded or applied:  # receipts, replays and the encode cache see the conversation as rendered
            raw = json.dumps(body, ensure_ascii=False).encode()
        call = anthropic_map.parse_messages_call(body, defaults, limit(), signer=signer)
        asked, compared_with = cache_diagnostics.anthropic_asked(body)
        managed = {} if applied is None else {"context_management": {"applied_edits": applied}}
        prompt = await encoded(engine, cache, call, "messages", raw, rules)
        sub = submit(engine, call, prompt, "api", session_from(request.headers, body, call), raw, rules)
        fingerprint = []  # computed once, on a worker thread (a long conversation takes milliseconds)

        def diagnosed(cached_tokens: int) -> dict:  # the Message's `diagnostics`, when asked
            if not asked:
                return {}
            fingerprint.append(cache_diagnostics.anthropic_fingerprint(body, len(prompt)))
            verdict = None if compared_with is None else diagnostics.compare(compared_with, fingerprint[0], cached_tokens,
                                                                              "messages_changed")
            return {"diagnostics": cache_diagnostics.anthropic_diagnostics(verdict)}

        def held(reply: dict) -> dict:  # a threaded turn's conversation is kept under the reply's id
            if threaded:
                threads.hold(reply["id"], whole, reply["content"])
            if fingerprint:
                diagnostics.remember(reply["id"], fingerprint[0])
            return reply

        summarising = body.get("compaction") is not None  # the reply is one compaction block
        reply_of = anthropic_map.compacted if summarising else anthropic_map.message
        if not call.stream:
            return await _whole(sub, lambda fin: held({**reply_of(model_name, fin, signer), **diagnosed(fin.cached_tokens),
                                                       **managed}), request, budget_headers(call, sub))
        frames = anthropic_map.MessageStream(model_name, signer)

        async def stream():
            async for event in events(sub):
                if isinstance(event, Restored):  # message_start reports the cache split, known now
                    extra = await asyncio.to_thread(diagnosed, event.cached_tokens)
                    for name, data in frames.start(event.prompt_tokens, event.cached_tokens, extra):
                        yield event_watch.sse(name, data)
                elif isinstance(event, PrefillProgress):  # Anthropic's own keep-alive event
                    yield event_watch.sse("ping", {"type": "ping"})
                elif isinstance(event, Tokens) and not summarising:
                    for name, data in frames.tokens(event):
                        yield event_watch.sse(name, data)
                elif isinstance(event, Finished):
                    finish = frames.compacted(event) if summarising else frames.finish(event)
                    # held before message_stop: the client may continue the thread at once
                    await asyncio.to_thread(held, {"id": frames.id, "content": frames.content})
                    for name, data in finish:  # the applied edits ride on message_delta, as the API's
                        yield event_watch.sse(name, {**data, **managed} if name == "message_delta" else data)
                elif isinstance(event, Failed):
                    failure = _failure(event)
                    yield event_watch.sse("error", anthropic_map.error_body(failure.status, failure.message))

        return _streamed(request, sub, stream(), budget_headers(call, sub))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        raw, body = await body_of(request)
        body, threaded = await asyncio.to_thread(threads.expand, body)
        original = body
        body, applied = await asyncio.to_thread(context_edits.apply, body, prompt_size)
        if threaded or applied:
            raw = json.dumps(body, ensure_ascii=False).encode()
        call = anthropic_map.parse_messages_call(body, defaults, limit(), require_max_tokens=False, signer=signer)
        counted = {"input_tokens": len(await encoded(engine, cache, call, "count_tokens", raw))}
        if applied is not None:  # what the edits took away, as the API reports it
            counted["context_management"] = {"original_input_tokens": counted["input_tokens"] if not applied
                                             else await asyncio.to_thread(prompt_size, original)}
        return counted

    # -- vLLM's tokenizer endpoints (lm-evaluation-harness's remote tokenizer) ----------------
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_api.info(tokenizer, limit())

    @app.post("/tokenize")
    async def tokenize(request: Request):
        raw, body = await body_of(request)
        if "messages" not in body:
            tokens = await asyncio.to_thread(tokenizer_api.prompt_tokens, body, tokenizer)
        else:
            call = parse_chat(body, defaults, limit())
            if body.get("add_generation_prompt", True) is not False:  # the prompt the chat route would run
                tokens = await encoded(engine, cache, call, "tokenize", raw)
            else:
                tokens, _ = await asyncio.to_thread(render_call, engine, call, False)
        return tokenizer_api.answer(tokens, tokenizer, limit(), body)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        raw, body = await body_of(request)
        return await asyncio.to_thread(tokenizer_api.detokenized, body, tokenizer)

    return app


async def _cancel_on_disconnect(request: Request, sub) -> None:
    """Cancel the turn the moment its client goes away: the body has been read, so the next ASGI
    message is the disconnect (waited for, not polled, so a resend that follows the close is
    planned after the cancel). The engine ends it at its next chunk or step and banks a cancelled
    prefill's prefix."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    sub.cancel()


def _streamed(request: Request, sub, body: AsyncIterator[bytes], headers: dict) -> StreamingResponse:
    """A turn's SSE response that also ends the turn the moment its client goes away. A write to a
    closed connection fails too, but a long prefill writes once per chunk (seconds apart on a slow
    machine); an agent that gave up resends at once, and its resend must find the abandoned
    prompt's computed prefix already banked (the engine ends cancelled prefills before it admits
    the next request)."""

    async def watched():
        watcher = asyncio.create_task(_cancel_on_disconnect(request, sub))
        try:
            async for chunk in body:
                yield chunk
        finally:
            watcher.cancel()

    return StreamingResponse(watched(), media_type="text/event-stream", headers=headers)


async def _openai_sse(sub, chunks, include_usage: bool, first: dict | None = None):
    """One OpenAI stream (chat or text completion, by `chunks`), ended by [DONE]."""
    if first is not None:
        yield _sse(first)
    async for event in events(sub):
        for frame in _frames(event, chunks, include_usage):
            yield frame
    yield _sse("[DONE]")


def _frames(event, chunks, include_usage: bool) -> list[bytes]:
    """One engine event of an OpenAI stream as SSE frames (chat or text, by `chunks`)."""
    if isinstance(event, PrefillProgress):
        return [b": prefill\n\n"]  # bytes during a long prefill keep clients' idle timers from firing
    if isinstance(event, Tokens):
        return [_sse(c) for c in chunks.tokens(event)]
    if isinstance(event, Finished):
        return [_sse(c) for c in chunks.finish(event, include_usage)]
    if isinstance(event, Failed):
        return [_sse(_failure(event).body())]
    return []


async def _choices_sse(subs: list, streams: list, include_usage: bool, firsts: list, n: int | None = None):
    """Several choices streamed as one completion (chat or text, by `streams`): each choice's
    chunks carry its index, as its tokens come (the choices decode together), then one usage for
    all of them when asked (`n` choices a prompt; None: one prompt). `firsts`: each choice's
    opening chunk, or None."""
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, sub) -> None:
        try:
            async for event in events(sub):
                await arrived.put((i, event))
        finally:
            await arrived.put((i, None))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(subs)]
    fins: list = [None] * len(subs)
    try:
        for chunk in firsts:
            if chunk is not None:
                yield _sse(chunk)
        running = len(subs)
        while running:
            i, event = await arrived.get()
            if event is None:
                running -= 1
                continue
            if isinstance(event, Finished):
                fins[i] = event
            if i == 0 or not isinstance(event, PrefillProgress):  # one keep-alive per prefill chunk
                for frame in _frames(event, streams[i], False):
                    yield frame
        if include_usage and all(fins):
            yield _sse(streams[0].usage_chunk(fins, n))
    finally:
        for task in pumps:
            task.cancel()
    yield _sse("[DONE]")


def _no_response(response_id: str) -> ApiError:
    return ApiError(404, f"response {response_id!r} is not kept by this server (unknown, deleted, sent with "
                         "store: false, or past the most recently used it keeps)", None, "invalid_request_error",
                    "response_not_found")


def _failure(event: Failed) -> ApiError:
    if event.kind == "invalid_request":
        return bad_request(event.message)
    if event.kind == "unavailable":
        return ApiError(503, event.message, None, "server_error", "engine_unavailable")
    return ApiError(500, event.message, None, "server_error")


async def _whole(sub, build, request: Request, headers: dict | None = None):
    """Run a non-streamed turn to the end; a client that goes away cancels it. A Choices group
    (chat's `n`) runs every choice and builds from the list of their Finished events."""

    watcher = asyncio.create_task(_cancel_on_disconnect(request, sub))
    try:
        fins = await asyncio.gather(*(_finished(s) for s in getattr(sub, "subs", [sub])))
    finally:
        watcher.cancel()
    # off the event loop: a build may write a store (the Responses route's conversation)
    return JSONResponse(await asyncio.to_thread(build, fins if isinstance(sub, Choices) else fins[0]), headers=headers)


async def _finished(sub) -> Finished | None:
    fin = None
    async for event in events(sub):
        if isinstance(event, Finished):
            fin = event
        elif isinstance(event, Failed):
            raise _failure(event)
    return fin


def serve_forever(app: FastAPI, sock, on_signal=lambda: None) -> list[int]:
    """Serve on a bound socket until SIGTERM or SIGINT; returns the signals received.

    On a signal uvicorn stops accepting and gives open connections a few seconds; `on_signal`
    (the engine's cancel_all) ends every turn at its next step, so each stream still closes with
    its final chunk instead of being cut. uvicorn then raises the signal again for the previous
    handler; ours only records it, so the caller's `finally` runs: the engine flushes the bank to
    SSD and the process exits 0. A second ctrl+c during that exits at once."""
    import signal

    import uvicorn

    received: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            on_signal()
            app.state.watchers.close_all()  # a watcher's stream never ends by itself

    def record(sig, frame):
        if received and sig == signal.SIGINT:
            raise SystemExit(130)
        received.append(sig)

    previous = {sig: signal.signal(sig, record) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        sock.close()
    if not received:  # after a signal ours stay, so the caller's clean-up is not cut short
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received
