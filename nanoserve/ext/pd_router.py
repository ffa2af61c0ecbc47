"""An extension, and an application of two engines: the disaggregated pair (ext/kv_transfer) behind one
OpenAI-compatible endpoint, one command:

    torchrun --nproc-per-node 2 -m nanoserve.ext.pd_router --model DIR --port 8000 [engine and server flags]
    # two machines: torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --rdzv-endpoint HOST:PORT
    #               -m nanoserve.ext.pd_router --model DIR --internal-host 0.0.0.0 ...

Why an extension of its own: as the OpenAI server (ext/server) is an application of the engine beside the engine's
ideas, this router is an application of the pair beside the idea that pairs the engines (ext/kv_transfer, which runs
without it: two offline LLMs in two processes). It imports both, and changes neither: ext/server's main runs each
rank's server, its error_body and server_sent shape the router's errors.

Each rank runs an engine and the OpenAI server (ext/server, unchanged: its main with this rank's kv_transfer_config
and an internal port) on --internal-host; rank 0 is the prefill engine (kv_producer), rank 1 the decode engine
(kv_consumer), which publishes its server's address in the launcher's rendezvous store. Beside the prefill engine,
the router listens on --host:--port, and answers /v1/completions and /v1/chat/completions in two steps:
  1) prefill: the request, as one sample of one token and not streamed, to the prefill engine, which computes the
     prompt and sends its K/V to the decode engine (a refusal there, a bad field, is the answer);
  2) decode: the request as it came to the decode engine, which loads that K/V and generates every token; its answer,
     streamed or whole, is relayed as it comes.
/v1/models is the decode engine's; /health is 200 when both engines are. An engine that cannot be reached, or fails
mid-answer, is named in a 502 (or the stream's error event); the engines name a peer that died or hangs themselves
(link.py) and fail the requests it held. Every other flag is the server's (python -m nanoserve.ext.server --help)."""

import argparse
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator

import httpx
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from nanoserve.ext.kv_transfer.link import PAIR, START_TIMEOUT
from nanoserve.ext.server import app
from nanoserve.ext.server.shared import DEFAULT_PORT, LOCALHOST, server_sent

USAGE = "usage: torchrun --nproc-per-node 2 -m nanoserve.ext.pd_router --model DIR [--port PORT] [server flags]"
ROLES = ("kv_producer", "kv_consumer")  # rank 0's, rank 1's
DECODE_URL_KEY = "nanoserve/kv_transfer/decode_url"
HEALTH_POLL_S = 0.5  # how often the router checks, before it listens, whether both servers are up
FORWARDED = ("authorization", "x-api-key", "content-type")  # request headers passed on to the engines


def main(argv: list[str] | None = None) -> None:
    """One rank of the pair: its server on a free internal port, and on rank 0 the router (in a thread) too."""
    if "RANK" not in os.environ or os.environ.get("WORLD_SIZE") != str(PAIR):
        raise SystemExit(USAGE)
    rank = int(os.environ["RANK"])
    parser = argparse.ArgumentParser("nanoserve.ext.pd_router", usage=USAGE)
    parser.add_argument("--host", default=LOCALHOST, help="the router's address (rank 0)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the router's port")
    parser.add_argument("--internal-host", default=LOCALHOST, help="where each rank's server listens")
    args, server_flags = parser.parse_known_args(argv)
    with socket.socket() as probe:  # a free port for this rank's server
        probe.bind((args.internal_host, 0))
        port = probe.getsockname()[1]
    advertised = args.internal_host
    if advertised == "0.0.0.0":
        advertised = socket.gethostname()
    url = f"http://{advertised}:{port}/v1"
    if rank == 0:
        threading.Thread(target=serve_router, args=(args.host, args.port, url), daemon=True).start()
    else:  # in a thread: the store is rank 0's where no torchrun agent hosts it, and rank 0 may still be loading
        threading.Thread(target=lambda: store().set(DECODE_URL_KEY, url), daemon=True).start()
    transfer = json.dumps({"kv_role": ROLES[rank]})
    app.main([*server_flags, "--host", args.internal_host, "--port", str(port), "--kv-transfer-config", transfer])


def store() -> dist.TCPStore:
    """A connection to the launcher's rendezvous store (MASTER_ADDR:MASTER_PORT), waiting for it as long as start-up
    may take."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=START_TIMEOUT)


def serve_router(host: str, port: int, prefill: str) -> None:
    """Rank 0's router: once the decode engine's address is known and both servers answer /health."""
    decode = store().get(DECODE_URL_KEY).decode()
    for url in (prefill, decode):
        while not is_healthy(url):
            time.sleep(HEALTH_POLL_S)
    uvicorn.Server(uvicorn.Config(router_app(prefill, decode), host, port, log_level="warning")).run()


def is_healthy(url: str) -> bool:
    try:
        return httpx.get(url.removesuffix("/v1") + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def router_app(prefill: str, decode: str) -> FastAPI:
    """The router for the servers at these base URLs (http://HOST:PORT/v1)."""
    router = FastAPI(title="nanoserve: prefill and decode apart")
    client = httpx.AsyncClient(timeout=None)  # an answer takes as long as it takes; a dead engine fails at once

    @router.post("/v1/completions", response_model=None)
    @router.post("/v1/chat/completions", response_model=None)
    async def generate(http: Request) -> Response:
        raw = await http.body()
        headers = {name: http.headers[name] for name in FORWARDED if name in http.headers}
        path = http.url.path.removeprefix("/v1")
        body = parsed(raw)
        if isinstance(body, dict):  # 1) prefill (a body that is no JSON object: the decode engine says why)
            try:
                answer = await client.post(prefill + path, json=prefill_body(body), headers=headers)
            except httpx.HTTPError as error:
                return unreachable("the prefill engine", prefill, error)
            if answer.status_code != 200:
                return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        try:  # 2) decode, relayed as it comes
            request = client.build_request("POST", decode + path, content=raw, headers=headers)
            response = await client.send(request, stream=True)
        except httpx.HTTPError as error:
            return unreachable("the decode engine", decode, error)
        media_type = response.headers.get("content-type")
        return StreamingResponse(relayed(response, decode), response.status_code, media_type=media_type)

    @router.get("/v1/models")
    async def models(http: Request) -> Response:
        try:
            answer = await client.get(
                decode + "/models", headers={k: v for k, v in http.headers.items() if k in FORWARDED}
            )
        except httpx.HTTPError as error:
            return unreachable("the decode engine", decode, error)
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    @router.get("/health")
    def health() -> Response:
        for name, url in (("prefill", prefill), ("decode", decode)):
            if not is_healthy(url):
                return JSONResponse(error_body(503, f"the {name} engine at {url} is not healthy"), 503)
        return Response(status_code=200)

    return router


def parsed(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def prefill_body(body: dict) -> dict:
    """The request as the prefill engine runs it: one sample of one token, whole (what matters is its K/V)."""
    one = {**body, "n": 1, "stream": False}
    one.pop("stream_options", None)
    one.pop("min_tokens", None)
    one["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = 1
    return one


def error_body(status: int, message: str) -> dict:
    """The server's error body (OpenAI's shape) for the router's own answers: a 502 or 503 is the engines' fault."""
    return app.error_body(HTTPException(status), message)


def unreachable(name: str, url: str, error: Exception) -> JSONResponse:
    return JSONResponse(error_body(502, f"{name} at {url} failed: {error!r}"), 502)


async def relayed(response: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """The decode engine's answer as it comes; if the engine fails mid-answer, an error event naming it ends it."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as error:
        message = f"the decode engine at {url} failed mid-answer: {error!r}"
        yield (server_sent(error_body(502, message)) + "data: [DONE]\n\n").encode()
    finally:
        await response.aclose()


if __name__ == "__main__":
    main()
