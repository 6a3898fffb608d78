"""Request bodies of the OpenAI endpoint (pipeline.serve.openai.app): what is accepted, what is refused.

Every field of a body is either implemented, accepted because it cannot change the answer
(``user``, ``stream_options``, ``n: 1``), accepted at its default value only (``presence_penalty: 0``),
or refused with a 400 naming it: nothing is silently ignored (docs/serving.md lists them), except
``messages[].name``, which reaches the chat template as it is and is dropped by a template that does
not use it (as in transformers). Integers
are bounded by what the generation model's inputs hold (INT32 / INT64), and every string must be
valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"`` cannot be encoded as UTF-8).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
#: Most prompts of one /v1/completions request (each is one generation request to Triton).
MAX_PROMPTS = 256
#: Most stop sequences of one request (OpenAI's limit).
MAX_STOPS = 4
#: OpenAI fields this endpoint does not implement -> the values that mean "not used" (accepted).
NOT_IMPLEMENTED: dict[str, tuple] = {
    "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
    "metadata": (None,), "service_tier": (None, "auto", "default"), "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0), "min_tokens": (None, 0), "verbosity": (None,),
}


class ApiError(Exception):
    """An error answered in OpenAI's JSON shape with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    """Fields common to both routes (see the module docstring for the rest)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None  # extension (vLLM)
    seed: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: Literal[1] = 1
    user: str | None = None  # an end-user id for abuse monitoring: recorded nowhere, changes nothing
    ignore_eos: bool = False  # extension (vLLM): fixed-length outputs for benchmarks
    return_token_ids: bool = False  # extension: each choice also lists its token ids

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT64_MAX)]], Field(min_length=1)]


class CompletionRequest(_Request):
    """``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists
    (a list of several = a batch: one choice per prompt). ``echo`` and ``logprobs`` (0-5):
    the loglikelihood contract (with ``echo``, ``max_tokens`` may be 0)."""

    max_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch (one for a single string or token-id list)."""
        prompt: Any = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class ChatMessage(BaseModel):
    """One chat message. ``name`` (OpenAI's participant name; AIPerf 0.5's chat sends ``"text"``)
    goes to the chat template with the message, as transformers' ``apply_chat_template`` hands
    the template each message dict as it is: a template that does not read it drops it."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts (checked in parse_request)
            return "".join(str(p.get("text", "")) for p in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, str]:
        """The message as the chat template sees it: ``role``, ``content`` (text), and ``name`` when given."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(_Request):
    """Chat: ``logprobs: true`` (+ ``top_logprobs`` 0-20) gives each generated token's logprob."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's and lm-eval's remote tokenizer): ``prompt`` -> token ids with the
    served tokenizer.json; ``add_special_tokens`` as the tokenizers library applies it (default true)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids -> text, special tokens kept (``prompt`` in the answer)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


#: what ``prompt`` may be (OpenAI's completions API)
PROMPT_FORMS = "a string, a list of strings, a list of token ids (integers) or a list of such lists"

Body = TypeVar("Body", bound=BaseModel)


def parse_request(cls: type[Body], body: Any) -> Body:
    """Validate a JSON body; the first problem becomes a 400 naming the field.

    Raises:
        ApiError: 400, ``param`` = the dotted field path (``messages.0.role``): a bad value, an
            unsupported parameter, or a string that is not valid Unicode.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_unicode(body, "")
    body = _drop_unused(body)
    if cls is ChatRequest:
        _check_content_parts(body)
    _check_stop(body.get("stop"))
    try:
        req = cls.model_validate(body, strict=True)  # JSON types as sent: "2" is no integer, true no token id
    except ValidationError as e:
        first = e.errors()[0]
        path = [str(p) for p in first["loc"] if not str(p).startswith(("list[", "str", "int", "function-"))]
        name = ".".join(path) or "body"
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"{name}: not a parameter this endpoint supports (docs/serving.md lists them)",
                           param=name, code="unsupported_parameter") from None
        if path[:1] == ["prompt"] and cls is CompletionRequest:
            raise ApiError(400, f"prompt: {PROMPT_FORMS}; got {body.get('prompt')!r}"[:400], param="prompt") from None
        raise ApiError(400, f"{name}: {first['msg']} (got {first.get('input')!r})", param=name) from None
    _check_combinations(req)
    return req


def _check_unicode(value: Any, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"{path or 'body'}: not valid Unicode ({e.reason} at character {e.start}); "
                                "send UTF-8 text without lone surrogates", param=path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path)
            _check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{path}.{i}")


def _drop_unused(body: dict) -> dict:
    """``body`` without the unimplemented fields that hold their "not used" value.

    Raises:
        ApiError: 400 an unimplemented field with another value.
    """
    out = {}
    for key, value in body.items():
        if key not in NOT_IMPLEMENTED:
            out[key] = value
        elif value not in NOT_IMPLEMENTED[key]:
            raise ApiError(400, f"{key}: not supported by this endpoint (got {value!r}); leave it out "
                                "(docs/serving.md lists the supported parameters)", param=key,
                           code="unsupported_parameter")
    return out


def _check_stop(stop: Any) -> None:
    """``stop``: absent, a string or a list of at most :data:`MAX_STOPS` strings, said as such (the
    schema's union would answer a long list with "Input should be a valid string").

    Raises:
        ApiError: 400 naming ``stop`` (or ``stop.<i>``, a list item that is no string).
    """
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list):
        raise ApiError(400, f"stop: a string or a list of at most {MAX_STOPS} strings; got {stop!r}"[:400], param="stop")
    if len(stop) > MAX_STOPS:
        raise ApiError(400, f"stop: at most {MAX_STOPS} stop sequences (as OpenAI's API allows); got {len(stop)}",
                       param="stop")
    for i, item in enumerate(stop):
        if not isinstance(item, str):
            raise ApiError(400, f"stop.{i}: a string; got {item!r}"[:400], param=f"stop.{i}")


def _check_content_parts(body: dict) -> None:
    for i, message in enumerate(body.get("messages") or []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ApiError(400, f"messages.{i}.content.{j}: only text parts ({{'type': 'text', 'text': ...}}) "
                                    f"are supported; got a {kind!r} part", param=f"messages.{i}.content.{j}.type",
                               code="unsupported_parameter")


def _check_combinations(req: BaseModel) -> None:
    if isinstance(req, _Request) and req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: allowed only with stream true (as OpenAI's API refuses it otherwise); "
                            "leave it out or send stream true", param="stream_options")
    if isinstance(req, CompletionRequest):
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens: 0 is allowed only with echo (score the prompt); "
                                "send an integer >= 1", param="max_tokens")
        if req.stream and (req.echo or req.logprobs is not None):
            param = "echo" if req.echo else "logprobs"
            raise ApiError(400, f"{param}: not supported with stream; send stream false", param=param)
        if req.stream and len(req.prompts()) > 1:
            raise ApiError(400, "prompt: several prompts in one streamed request are not supported; "
                                "send stream false, or one prompt per request", param="prompt")
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs true", param="top_logprobs")
        if req.stream and req.logprobs:
            raise ApiError(400, "logprobs: not supported with stream; send stream false", param="logprobs")
