"""The OpenAI Batch file format for ``task: generate``: requests in, responses out.

A request line (``input_format: "openai"``) is ``{"custom_id": str, "method": "POST", "url":
"/v1/chat/completions" | "/v1/completions", "body": {...}}``: the body's ``messages`` (chat) or ``prompt``
(completions) is the row's prompt, ``custom_id`` its id, and its ``max_tokens`` (or
``max_completion_tokens``), ``temperature``, ``top_p``, ``stop``, ``seed`` and ``response_format``
override the spec's ``generation`` for that row; its ``n`` must equal the spec's. A line that is not such
a request is a bad row (``on_bad_row``).

A response line (``output_format: "openai"``) is ``{"id", "custom_id", "response": {"status_code": 200,
"request_id", "body": <a chat.completion or text_completion object>}, "error": null}``, or for a row that
ended with an error ``"response": null, "error": {"code", "message"}``, one per row in input order. As
OpenAI says of its own files: join on ``custom_id``.
"""

from __future__ import annotations

import json
from typing import Any

URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
OVERRIDES = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "n",
    "response_format",
)


def read_request(doc: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """``(custom_id, prompt, params)`` of a request line; :class:`ValueError` saying what is wrong."""
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    url = doc.get("url")
    if url not in URLS:
        raise ValueError(f"url {url!r} is not one of {', '.join(URLS)}")
    if doc.get("method", "POST") != "POST":
        raise ValueError(f"method {doc.get('method')!r} is not POST")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be an object")
    if body.get("stream"):
        raise ValueError("body.stream: a batch request is not streamed")
    prompt = body.get(URLS[url])
    params = {k: body[k] for k in OVERRIDES if k in body and body[k] is not None}
    params["url"] = url
    if isinstance(body.get("model"), str):
        params["model"] = body["model"]
    return custom_id, prompt, params


def sampling(
    params: dict[str, Any], defaults: Any
) -> tuple[int, float, float, tuple[str, ...], int, int, Any]:
    """``(max_tokens, temperature, top_p, stop, seed, n, response_format)`` of one request: its body's
    values over the spec's ``generation``; :class:`ValueError` naming a bad one."""
    from pydantic import ValidationError

    from shardfold.functions.inference.spec import ResponseFormat

    max_tokens = params.get("max_completion_tokens", params.get("max_tokens", defaults.max_tokens))
    temperature = params.get("temperature", defaults.temperature)
    top_p = params.get("top_p", defaults.top_p)
    stop = params.get("stop", defaults.stop)
    seed = params.get("seed", defaults.seed)
    n = params.get("n", defaults.n)
    stop = [stop] if isinstance(stop, str) else stop
    checks = [
        ("max_tokens", max_tokens, _int(max_tokens) and 1 <= max_tokens <= 32768),
        ("temperature", temperature, _number(temperature) and 0 <= temperature <= 2),
        ("top_p", top_p, _number(top_p) and 0 < top_p <= 1),
        (
            "stop",
            stop,
            isinstance(stop, list) and len(stop) <= 16 and all(isinstance(s, str) and s for s in stop),
        ),
        ("seed", seed, _int(seed) and 0 <= seed < 2**63),
        ("n", n, n == defaults.n),
    ]
    for name, value, ok in checks:
        if not ok:
            hint = f" (the job's generation.n is {defaults.n})" if name == "n" else ""
            raise ValueError(f"body.{name} {json.dumps(value)[:60]} is not valid{hint}")
    response_format = defaults.response_format
    if "response_format" in params:
        try:
            response_format = ResponseFormat.model_validate(params["response_format"])
        except ValidationError as exc:
            raise ValueError(f"body.response_format is not valid: {exc.errors()[0]['msg']}") from None
    return max_tokens, float(temperature), float(top_p), tuple(stop), seed, n, response_format


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def response_line(
    job_id: str, row: int, custom_id: str, model: str, created: int, out: dict[str, Any], error: str | None
) -> str:
    """One output line (see the module doc): ``out`` holds the row's ``texts``, ``finish_reasons``,
    ``completion_tokens`` (one per choice), ``prompt_tokens`` and its request's ``params``."""
    request_id = f"{job_id}-{row}"
    line: dict[str, Any] = {"id": f"batch_req_{request_id}", "custom_id": custom_id}
    if error:
        line.update(response=None, error={"code": "row_error", "message": error})
        return json.dumps(line, ensure_ascii=False)
    params = out["params"]
    chat = params.get("url", "/v1/chat/completions") == "/v1/chat/completions"
    choices = [
        {
            "index": c,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": why,
        }
        if chat
        else {"index": c, "text": text, "logprobs": None, "finish_reason": why}
        for c, (text, why) in enumerate(zip(out["texts"], out["finish_reasons"], strict=True))
    ]
    completion = int(sum(out["completion_tokens"]))
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": params.get("model", model),
        "choices": choices,
        "usage": {
            "prompt_tokens": int(out["prompt_tokens"]),
            "completion_tokens": completion,
            "total_tokens": int(out["prompt_tokens"]) + completion,
        },
    }
    line.update(response={"status_code": 200, "request_id": request_id, "body": body}, error=None)
    return json.dumps(line, ensure_ascii=False)
