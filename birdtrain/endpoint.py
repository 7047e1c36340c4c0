"""The client of any OpenAI-compatible chat endpoint (vLLM, ``transformers serve``, a hosted API).

Two roles use it: the teacher that writes synthetic data (:mod:`birdtrain.data`) and the agent an
evaluation plays (:class:`birdtrain.policies.EndpointPolicy`). Only the standard library talks to
it (``urllib``), so it adds no dependency. The environment and the training data know tool calls
only as ``<tool_call>{json}</tool_call>`` text: a conversation goes out in OpenAI's tool-calling
form (:func:`openai_messages`), and a reply's structured ``tool_calls`` are written back as text
with :func:`birdenv.tools.format_tool_call`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from birdenv.errors import BirdEnvError
from birdenv.tools import ToolCallError, format_tool_call, parse_tool_call

__all__ = ["Teacher", "TeacherError", "openai_messages"]


class TeacherError(BirdEnvError, RuntimeError):
    """The teacher endpoint could not be reached or gave an unusable answer."""


def _endpoint(url: str) -> str:
    """``/v1/chat/completions`` under ``url``, whether ``url`` names the server, ``/v1`` or the route."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class Teacher:
    """A chat model behind an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    ``url`` may be the server (``http://127.0.0.1:8000``), its ``/v1`` root or the full route;
    ``api_key`` is sent as a bearer token when given; ``timeout`` bounds each request in seconds.
    ``requests`` counts the calls made (for reports).

    >>> Teacher("http://127.0.0.1:8000", "m").endpoint
    'http://127.0.0.1:8000/v1/chat/completions'
    """

    def __init__(
        self, url: str, model: str, api_key: str | None = None, timeout: float = 120.0
    ) -> None:
        if not url or not model:
            raise ValueError("a teacher needs both a url and a model name")
        self.url = url
        self.endpoint = _endpoint(url)
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.requests = 0

    def __repr__(self) -> str:
        return f"Teacher({self.endpoint!r}, model={self.model!r})"

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **params: Any,
    ) -> str:
        """The assistant's reply to ``messages`` as text (tool calls included as ``<tool_call>`` text).

        ``messages`` may hold tool calls in the environment's text form: they are sent in OpenAI's
        tool-calling form (:func:`openai_messages`). ``params`` (``temperature``, ``max_tokens``,
        ...) go into the request body as they are. Raises :class:`TeacherError` when the server is unreachable, answers with an HTTP error
        (its body is quoted) or returns something that is not a chat completion.
        """
        body: dict[str, Any] = {
            "model": self.model,
            "messages": openai_messages(messages),
            **params,
        }
        if tools:
            body["tools"] = tools
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.endpoint, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        self.requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:2000]
            raise TeacherError(
                f"teacher at {self.endpoint} answered HTTP {exc.code} {exc.reason}: {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TeacherError(
                f"teacher at {self.endpoint} is unreachable ({reason}); is the server running, "
                "and are --teacher-url and the port right?"
            ) from None
        return _reply_text(raw, self.endpoint)


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An environment conversation in OpenAI's tool-calling form.

    The environment keeps each turn as text, with its tool call as ``<tool_call>{json}</tool_call>``.
    An assistant turn that holds one valid call becomes ``content`` (the text before the call, or
    ``None``) plus ``tool_calls`` with an id, and the observation that answers it a ``tool`` message
    with that ``tool_call_id``. An observation that answers no call (the turn's call was missing or
    malformed) becomes a ``user`` message, since a ``tool`` message must answer a call.

    >>> from birdenv.tools import format_tool_call
    >>> turn = "Look.\\n" + format_tool_call("execute_sql", sql="SELECT 1")
    >>> for m in openai_messages([{"role": "user", "content": "Fix it"},
    ...                           {"role": "assistant", "content": turn},
    ...                           {"role": "tool", "content": "status: ok"}]):
    ...     print(m)
    {'role': 'user', 'content': 'Fix it'}
    {'role': 'assistant', 'content': 'Look.', 'tool_calls': [{'id': 'call_1', 'type': 'function', 'function': {'name': 'execute_sql', 'arguments': '{"sql": "SELECT 1"}'}}]}
    {'role': 'tool', 'tool_call_id': 'call_1', 'content': 'status: ok'}
    """
    out: list[dict[str, Any]] = []
    pending: str | None = None  # the id of the call the next observation answers
    calls = 0
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant":
            try:
                call = parse_tool_call(content)
            except ToolCallError:
                out.append({"role": "assistant", "content": content})
                pending = None
                continue
            calls += 1
            pending = f"call_{calls}"
            start, end = content.index("<tool_call>"), content.index("</tool_call>")
            text = (content[:start] + content[end + len("</tool_call>") :]).strip()
            function = {"name": call.name, "arguments": json.dumps(call.arguments)}
            out.append(
                {
                    "role": "assistant",
                    "content": text or None,
                    "tool_calls": [{"id": pending, "type": "function", "function": function}],
                }
            )
        elif role == "tool" and pending is not None:
            out.append({"role": "tool", "tool_call_id": pending, "content": content})
            pending = None
        else:
            out.append({"role": "user" if role == "tool" else role, "content": content})
    return out


def _reply_text(raw: bytes, endpoint: str) -> str:
    """The text of the first choice of a chat-completion response body."""
    try:
        data = json.loads(raw)
        message = data["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise TeacherError(
            f"teacher at {endpoint} returned something that is not a chat completion: "
            f"{raw[:500].decode('utf-8', 'replace')!r}"
        ) from None
    if not isinstance(message, dict):
        raise TeacherError(f"teacher at {endpoint}: choices[0].message is not an object")
    text = message.get("content") or ""
    if not isinstance(text, str):
        raise TeacherError(f"teacher at {endpoint}: message content is not a string")
    for call in message.get("tool_calls") or []:
        try:
            function = call["function"]
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            text += ("\n" if text else "") + format_tool_call(function["name"], **arguments)
        except (KeyError, TypeError, AttributeError, ValueError):
            raise TeacherError(
                f"teacher at {endpoint} returned a malformed tool call: {call!r}"
            ) from None
    return text
