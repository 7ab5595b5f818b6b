"""The router's own answers, in the error shape vLLM's OpenAI server uses: {"error": {message, type, param, code}}.

One exception, as vLLM has it: a missing or wrong API key is answered {"error": "Unauthorized"}, the body of
vLLM's own authentication middleware.
"""

from __future__ import annotations

import json
import math

from aiohttp import web


def error(
    status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=headers
    )


def bad_request(message: str, param: str | None = None) -> web.Response:
    return error(400, message, "BadRequestError", param)


def unauthorized() -> web.Response:
    # vLLM's body, word for word; the header is HTTP's (RFC 9110 section 11.6.1), which vLLM leaves out.
    return web.json_response({"error": "Unauthorized"}, status=401, headers={"WWW-Authenticate": "Bearer"})


def no_model_named(resident: list[str], known: list[str]) -> web.Response:
    """A request without `model` when not exactly one model is resident to take it, as vLLM's one model would."""
    if resident:
        why = f"{len(resident)} models are resident ({', '.join(resident)})"
    else:
        why = "no model is resident to take it"
    message = f"The request names no `model`, and {why}; name one of: {', '.join(known) or '(none yet)'}."
    return error(400, message, "BadRequestError", "model")


def not_linked() -> web.Response:
    message = "The request names no `model`, and the router does not know its models yet; retry in a moment."
    return error(503, message, "ServiceUnavailableError", "model", headers=retry_after(1))


def gave_up(name: str, reason: str) -> web.Response:
    because = f": {reason}" if reason else ""
    message = f"The model `{name}` is not served: its engine failed and r3090d gave up on it{because}."
    return error(503, message, "ServiceUnavailableError", "model")


def unknown_model(name: str) -> web.Response:
    # vLLM 0.32's own words and shape for a model it does not serve.
    return error(404, f"The model `{name}` does not exist.", "NotFoundError", "model")


def not_found(path: str) -> web.Response:
    return error(404, f"No route {path} on this server.", "NotFoundError")


def too_large(limit: int) -> web.Response:
    return error(413, f"The request body is over the {limit}-byte limit.", "RequestTooLargeError")


def body_timeout(seconds: float) -> web.Response:
    return error(408, f"The request body did not arrive within {seconds:g} s.", "RequestTimeoutError")


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def queue_timeout(name: str, waited: float) -> web.Response:
    message = f"The model `{name}` did not become available within {waited:g} s; it is being brought in. Retry later."
    return error(503, message, "ServiceUnavailableError", "model", headers=retry_after(waited))


def shutting_down() -> web.Response:
    return error(
        503, "The router is restarting; retry in a moment.", "ServiceUnavailableError", headers=retry_after(1)
    )


def unreachable(name: str) -> web.Response:
    return error(502, f"The engine serving `{name}` could not be reached.", "BadGatewayError", "model")


def unreadable(name: str) -> web.Response:
    message = f"The engine serving `{name}` answered with something that is not HTTP."
    return error(502, message, "BadGatewayError", "model")
