"""Helpers every wire module shares: typed field access that names the bad field, SSE framing,
ids, and the API-neutral tool_choice form.

Every getter takes the object, the key and the path of the object (``"messages[2]"``), and raises
``ApiError(400, "<path>.<key>: ...", param="<path>.<key>")`` when the value has the wrong type.
JSON ``null`` counts as absent, as the APIs treat it for optional fields.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from typing import Any

import orjson

from legorl.proxy.chat import ApiError

JSONObject = dict[str, Any]

# Text parts of one message are joined with a newline, as vLLM's chat endpoints do: the template
# sees one string per message, and every API joins the same way so a round trip stays stable.
PART_SEPARATOR = "\n"

_ALNUM = string.ascii_letters + string.digits


def load_object(body: bytes) -> JSONObject:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "request body: expected a JSON object")
    return value


def at(where: str, key: str | int) -> str:
    """The path of ``key`` inside the object at ``where``: ``messages[2].content``."""
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def bad(path: str, problem: str, *, status: int = 400) -> ApiError:
    return ApiError(status, f"{path}: {problem}", param=path)


def missing(path: str) -> ApiError:
    return bad(path, "field required")


def wrong_type(path: str, expected: str) -> ApiError:
    return bad(path, f"expected {expected}")


def req_value(obj: JSONObject, key: str, where: str = "") -> Any:
    value = obj.get(key)
    if value is None:
        raise missing(at(where, key))
    return value


def opt_str(obj: JSONObject, key: str, where: str = "") -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    raise wrong_type(at(where, key), "a string")


def req_str(obj: JSONObject, key: str, where: str = "") -> str:
    value = opt_str(obj, key, where)
    if value is None:
        raise missing(at(where, key))
    return value


def opt_bool(obj: JSONObject, key: str, where: str = "") -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise wrong_type(at(where, key), "a boolean")


def opt_int(
    obj: JSONObject, key: str, where: str = "", *, minimum: int | None = None
) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(at(where, key), "an integer")
    if minimum is not None and value < minimum:
        raise bad(at(where, key), f"must be at least {minimum}")
    return value


def opt_number(obj: JSONObject, key: str, where: str = "") -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise wrong_type(at(where, key), "a number")
    return float(value)


def opt_list(obj: JSONObject, key: str, where: str = "") -> list[Any] | None:
    value = obj.get(key)
    if value is None or isinstance(value, list):
        return value
    raise wrong_type(at(where, key), "an array")


def req_list(obj: JSONObject, key: str, where: str = "") -> list[Any]:
    value = opt_list(obj, key, where)
    if value is None:
        raise missing(at(where, key))
    return value


def opt_object(obj: JSONObject, key: str, where: str = "") -> JSONObject | None:
    value = obj.get(key)
    if value is None or isinstance(value, dict):
        return value
    raise wrong_type(at(where, key), "an object")


def as_object(value: Any, path: str) -> JSONObject:
    if not isinstance(value, dict):
        raise wrong_type(path, "an object")
    return value


def str_list(value: Any, path: str) -> list[str]:
    """A string or a list of strings (OpenAI's ``stop``), as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise wrong_type(path, "a string or an array of strings")


def random_id(prefix: str, length: int) -> str:
    # Hex from one read of the OS's randomness: ids are made on every call, so keep it cheap.
    return prefix + secrets.token_hex((length + 1) // 2)[:length]


def id_style(prefix: str, length: int) -> Callable[[], str]:
    """A maker of fresh ids in one API's style: ``prefix`` and ``length`` random characters."""

    def make() -> str:
        return random_id(prefix, length)

    return make


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def sse(data: JSONObject, event: str | None = None) -> bytes:
    """One server-sent event; ``event:`` line only when the API names its events."""
    payload = orjson.dumps(data)
    if event is None:
        return b"data: " + payload + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + payload + b"\n\n"


def function_choice(name: str) -> JSONObject:
    """The API-neutral form of "call this tool" (OpenAI Chat's)."""
    return {"type": "function", "function": {"name": name}}


def openai_error(err: ApiError) -> JSONObject:
    """OpenAI's error object (Chat and Responses share it)."""
    kind = err.kind
    if err.status >= 500 and kind == "invalid_request_error":
        kind = "server_error"
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def openai_error_body(err: ApiError) -> bytes:
    """OpenAI's error body (Chat and Responses share it)."""
    return orjson.dumps(openai_error(err))
