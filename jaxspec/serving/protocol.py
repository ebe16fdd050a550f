"""The OpenAI-compatible wire protocol: request bodies, the limits at the door, errors in OpenAI's shape.

Pure data and checks (pydantic models, no engine, no web framework): errors are
``{"error": {"message", "type", "param", "code"}}`` with the status OpenAI uses: 400 for malformed
JSON, unknown or unsupported parameters, bad sampling values, grammars that do not compile (code
``invalid_grammar``) and requests past ``--max-model-len`` (code ``context_length_exceeded``, with
the numbers, as OpenAI does); 401 without the ``--api-key``; 404 for an unknown model; 413 past
``--max-body-bytes``; 429 when ``--max-queue`` requests already wait; 500 when generating one
request failed; 503 while the server shuts down or after its engine loop stopped.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxspec.engine.stops import MAX_STOPS

# Limits at the door: every field bounded before anything is tokenized or queued.
MAX_N = 128  # choices per request (and never more than --max-queue)
MAX_TOP_K = 2**31 - 1  # the device keeps top-k as int32; a larger value means "off" anyway
MAX_SEED = 2**63 - 1
MAX_TEXT_CHARS = 1 << 20  # characters per prompt or message
MAX_MESSAGES = 1024
DRAIN_BYTES = 64 << 20  # an over-limit body is read and dropped up to this, so a blocking client hears its 413
DRAIN_S = 30.0  # ... for at most this long
# Parameters this server does not implement, accepted only at values that ask for nothing
# (clients such as LangChain send them at their defaults); any other value is a 400.
NEUTRAL = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # meaningless without tools
}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # engine reason -> OpenAI finish_reason


# ---------------------------------------------------------------------------------------- request bodies

STRICT = ConfigDict(extra="forbid", strict=True)  # no silent coercion: "5", true or 5.0 is not an integer


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: a named schema (``strict`` is always honoured here)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, a regex or a Lark grammar."""

    model_config = STRICT
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None


class SamplingBody(BaseModel):
    """What both endpoints take; ``None`` means OpenAI's default."""

    model_config = STRICT
    model: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_SEED)
    temperature: float | None = Field(None, allow_inf_nan=False)  # default 1.0, as OpenAI
    top_p: float | None = Field(None, allow_inf_nan=False)
    top_k: int | None = Field(None, le=MAX_TOP_K)  # not OpenAI's; 0 (or -1, vLLM's) disables
    seed: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None  # each string: see launch
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    # structured output (jaxspec.structured): OpenAI's response_format, or vLLM's fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(max_length=MAX_TEXT_CHARS)
    best_of: Any = None
    echo: Any = None
    suffix: Any = None


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(max_length=MAX_TEXT_CHARS)


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_SEED)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def requested_grammar(body: SamplingBody):
    """(the ``Grammar`` the request's output must match or None, the parameter that asked for it); raises
    APIError 400 when several parameters ask for one or a grammar cannot be read."""
    from jaxspec.structured import Grammar, GrammarError  # noqa: PLC0415

    asked = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            asked.append(("response_format", lambda: Grammar("json_object")))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            asked.append(("response_format", lambda: Grammar.json_schema(rf.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar)) if v is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs takes exactly one of json, regex, grammar", "structured_outputs")
        asked.append(("structured_outputs", lambda: _grammar(*given[0])))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            asked.append((field, lambda kind=kind, value=value: _grammar(kind, value)))
    if not asked:
        return None, None
    if len(asked) > 1:
        raise APIError(400, f"give one structured-output parameter, got {', '.join(f for f, _ in asked)}", asked[1][0])
    field, make = asked[0]
    try:
        return make(), field
    except GrammarError as e:
        raise APIError(400, str(e), field) from None


def _grammar(kind: str, value):
    from jaxspec.structured import Grammar  # noqa: PLC0415

    if kind == "json":
        return Grammar.json_schema(value)
    return Grammar("regex" if kind == "regex" else "lark", value)


def refuse_unsupported(body: SamplingBody) -> None:
    """400 for any parameter this server does not implement, set to a value that asks for it."""
    for name, neutral in NEUTRAL.items():
        if name in type(body).model_fields:
            value = getattr(body, name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise APIError(400, f"parameter '{name}' is not supported by this server (got {value!r})", name,
                               "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options")



def sampling_param(message: str) -> str | None:
    for name, word in (("temperature", "temperature"), ("top_k", "top-k"), ("top_p", "top-p")):
        if word in message:
            return name
    return None



_UNION_TAG = re.compile(r"str|int|float|bool|list\[.*\]|dict\[.*\]")  # pydantic's union members in a loc


def validation_error(errors: list[dict]) -> APIError:
    """The most telling pydantic error as a 400 naming the parameter.

    A union field (``stop``: a string or a list) fails once per member; an error about the value
    (17 stop strings: too long) tells more than one about the member whose type it is not.
    """
    e = next((x for x in errors if not str(x.get("type", "")).endswith("_type")), errors[0])
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _UNION_TAG.fullmatch(str(x))]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if e.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None,
                        "invalid_json")
    if not loc:
        return APIError(400, f"the request needs a JSON object body ({e.get('msg')})", None, "invalid_body")
    if e.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported parameter '{where}': this server does not know it", param,
                        "unsupported_parameter")
    if e.get("type") == "missing":
        return APIError(400, f"missing required parameter '{where}'", param, "missing_parameter")
    return APIError(400, f"invalid parameter '{where}': {e.get('msg')} (got {e.get('input')!r})"[:500], param,
                    "invalid_parameter")



SHUTTING_DOWN = "the server is shutting down: this request was cancelled"
ENGINE_STOPPED = "the engine loop stopped; the server log has the cause"
