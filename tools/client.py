"""bench.py's own client for an OpenAI-compatible server over HTTP (`python bench.py --url`):
the check that the server is there and serves the model (check_server), one kept-alive
HTTP/1.1 connection per client (Connection), and the requests sent at their arrival times by
as many clients as asked, each streamed and timed from the client's side (send). It parses
only what it times: httpx spent ~0.1 s opening 256 connections at once, which a TTFT would
count.
"""

import asyncio
import collections
import json
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


def check_server(url: str, api_key: str | None, model: str) -> None:
    """SystemExit with one line naming bench.py's flag if the server at url (--url) cannot be
    reached, refuses the key, or does not serve model (--model; its /models says which it
    does), or is not plain http."""
    import httpx
    if urllib.parse.urlsplit(url).scheme != "http":
        raise SystemExit(f"error: --url {url}: bench.py times a server over plain HTTP (http://HOST:PORT/v1)")
    try:
        r = httpx.get(f"{url.rstrip('/')}/models", timeout=30,
                      headers={"authorization": f"Bearer {api_key or 'none'}"})
    except httpx.HTTPError as e:
        raise SystemExit(f"error: --url {url}: cannot reach the server ({type(e).__name__}: {e})") \
            from None
    if r.status_code != 200:
        raise SystemExit(f"error: --url {url}: GET /models answered {r.status_code} {r.text[:200]}")
    served = [m["id"] for m in r.json().get("data", [])]
    if model not in served:
        raise SystemExit(f"error: --model {model}: the server at {url} serves {', '.join(served)}")


class Connection:
    """One HTTP/1.1 connection to the server (plain http), opened at its first request and
    kept for the next (keep-alive), as a client's pool keeps it."""

    def __init__(self, url: str, api_key: str | None):
        self.at, self.api_key = urllib.parse.urlsplit(url), api_key
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post_events(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST body as JSON to path and yield each server-sent event's JSON as it comes; an
        answer other than 200 raises ServerError with its body. A stream not read to its end
        closes the connection (the next request opens another)."""
        at, whole = self.at, False
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(at.hostname, at.port or 80)
        reader = self.reader
        try:
            data = json.dumps(body).encode()
            self.writer.write(f"POST {at.path.rstrip('/')}{path} HTTP/1.1\r\nhost: {at.netloc}\r\n"
                              f"authorization: Bearer {self.api_key or 'none'}\r\n"
                              f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
                              .encode() + data)
            status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if status != 200:
                text = await reader.read(int(headers.get("content-length", 300)))
                raise ServerError(f"HTTP {status}: {text[:300].decode(errors='replace')}")
            pending = b""
            while size := int((await reader.readline()).strip() or b"0", 16):   # chunked, as SSE comes
                pending += await reader.readexactly(size)
                await reader.readline()
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    if event.startswith(b"data: {"):
                        yield json.loads(event[6:])
            whole = await reader.readline() == b"\r\n" and headers.get("connection") != "close"
        finally:
            if not whole:
                self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class ServerError(Exception):
    """The server answered a request with an error status."""


@dataclass
class Sent:
    """One request as its client saw it, on perf_counter's clock: when it was sent, its first
    token came (None: never) and its stream ended; its output tokens (the usage) and its
    error, if the server refused or failed it."""
    spec: object   # what was sent: bench.py's Spec
    sent: float
    first: float | None
    end: float
    tokens: int
    error: str | None


async def complete(conn: Connection, model: str, spec) -> Sent:
    """spec (bench.py's Spec) POSTed to /completions as a stream (token ids, greedy,
    ignore_eos, its usage asked for), timed: the first event with a choice is its first
    token, the stream's end its end, the usage its output tokens."""
    sent, first, n, error = time.perf_counter(), None, 0, None
    body = {"model": model, "prompt": spec.prompt_ids, "max_tokens": spec.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async for event in conn.post_events("/completions", body):
            first = first or (time.perf_counter() if event.get("choices") else None)
            n = (event.get("usage") or {}).get("completion_tokens", n)
            error = error or (event.get("error") or {}).get("message")
    except (OSError, ValueError, asyncio.IncompleteReadError, ServerError) as e:
        error = str(e) if isinstance(e, ServerError) else f"{type(e).__name__}: {e}"
    return Sent(spec, sent, first, time.perf_counter(), n, error)


async def send(url: str, api_key: str | None, model: str, specs: list, clients: int, start: float,
               done: Callable[[], object]) -> list[Sent]:
    """specs (bench.py's Spec) sent at their arrival times (s after start, on perf_counter's
    clock) by `clients` clients, each sending its next request when its last one ended, over
    the connection it keeps; in the order they ended, done() called after each."""
    queue, got = collections.deque(specs), []

    async def client() -> None:
        conn = Connection(url, api_key)
        try:
            while queue:
                spec = queue.popleft()
                await asyncio.sleep(max(0.0, start + spec.arrival - time.perf_counter()))
                got.append(await complete(conn, model, spec))
                done()
        finally:
            conn.close()
    await asyncio.gather(*(client() for _ in range(clients)))
    return got
