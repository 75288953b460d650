"""A stand-in policy: an OpenAI-compatible chat-completions server on 127.0.0.1.

No weights can be downloaded here, so the trainers' "model" is this server: it answers
``POST /v1/chat/completions`` (plain or ``stream: true``) and ``GET /v1/models`` with the
reply of a Python function of the request's messages. The policy it ships plays
``wordguess``: it keeps the words consistent with the feedback it has seen and guesses the
first one, so its episodes are deterministic under a seed and earn real rewards.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stadium.envs.wordguess import WORDS, score

Policy = Callable[[list[dict[str, Any]]], str]


def solver_guess(history: list[tuple[str, str]]) -> str:
    """The first word of the list consistent with every (guess, feedback) pair."""
    for word in WORDS:
        if all(score(word, guess) == marks for guess, marks in history):
            return word
    return WORDS[0]


def history_from_text(text: str) -> list[tuple[str, str]]:
    """The (guess, marks) pairs in a transcript of wordguess observations, in order.

    Each observation carries every guess so far and the marks of the last one, so the last
    ``guesses`` list pairs with the marks of every observation, in the order they came.
    """
    guesses = re.findall(r'"guesses":\s*\[([^\]]*)\]', text)
    marks = re.findall(r'"feedback":\s*"([GY.]{5})"', text)
    words = re.findall(r'"([a-z]{5})"', guesses[-1]) if guesses else []
    return list(zip(words, marks, strict=False))


def wordguess_policy(messages: list[dict[str, Any]]) -> str:
    """Reply with the next guess, reading the whole transcript (its user turns)."""
    transcript = "\n".join(
        _text(m.get("content")) for m in messages if m.get("role") != "assistant"
    )
    return solver_guess(history_from_text(transcript))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


class StubPolicy:
    """The running server: ``base_url`` (ends in ``/v1``) and every request it answered."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.requests: list[dict[str, Any]] = []
        self.errors: list[BaseException] = []
        self.base_url = ""


@contextmanager
def serve_policy(
    policy: Policy = wordguess_policy, model: str = "stand-in"
) -> Iterator[StubPolicy]:
    """Serve ``policy`` on 127.0.0.1:0 in a thread; a failure in a handler fails the caller."""
    stub = StubPolicy(policy)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/models"):
                data = {
                    "object": "list",
                    "data": [{"id": model, "object": "model", "owned_by": "stadium"}],
                }
                self._send(200, json.dumps(data).encode())
            else:
                self._send(404, b'{"error": {"message": "not found"}}')

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("content-length") or 0)
                request = json.loads(self.rfile.read(length) or b"{}")
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, b'{"error": {"message": "only /v1/chat/completions"}}')
                    return
                stub.requests.append(request)
                reply = stub.policy(request.get("messages", []))
                self._reply(request, reply)
            except BaseException as exc:  # surfaced by the context manager
                stub.errors.append(exc)
                self._send(500, json.dumps({"error": {"message": repr(exc)}}).encode())

        def _reply(self, request: dict[str, Any], reply: str) -> None:
            created = int(time.time())
            ident = f"chatcmpl-{len(stub.requests)}"
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            name = request.get("model", model)
            if not request.get("stream"):
                message = {"role": "assistant", "content": reply}
                choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
                body = {"id": ident, "object": "chat.completion", "created": created, "model": name,
                        "choices": [choice], "usage": usage}  # fmt: skip
                self._send(200, json.dumps(body).encode())
                return
            chunks = [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": reply},
                    "finish_reason": None,
                },
                {"index": 0, "delta": {}, "finish_reason": "stop"},
            ]
            events = b"".join(
                b"data: " + json.dumps({"id": ident, "object": "chat.completion.chunk",
                                        "created": created, "model": name, "choices": [c]}).encode()
                + b"\n\n"
                for c in chunks
            )  # fmt: skip
            self._send(200, events + b"data: [DONE]\n\n", "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    stub.base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, name="stub-policy", daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    if stub.errors:
        raise AssertionError(f"the stand-in policy failed: {stub.errors[0]!r}") from stub.errors[0]
