"""The OpenAI-compatible wire format of ``bdlora serve`` (vLLM's ``protocol`` layout): pydantic request models that
refuse what the server cannot honour, and response models whose JSON is what OpenAI clients parse.

Requests forbid unknown fields (an unknown parameter is a 400 naming it, as in the OpenAI API) and use strict types,
so ``"max_tokens": "5"`` is refused rather than coerced. Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from bdlora.serve.sampling import SamplingParams

MAX_STOP = 4
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's legacy API allows 5; vLLM 20)
MAX_STOP_CHARS = 256  # a stop string is matched against the text each step: bound what a request can make it cost
# Sampling temperatures in (0, MIN_TEMPERATURE) are refused: they mean "greedy" and should say so with 0.
MIN_TEMPERATURE = 1e-3
MAX_SEED = 2**63 - 1  # numpy's generators take any non-negative integer; bound it to a signed 64-bit one

Number = StrictFloat | StrictInt


def _encodable(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``) that is no character and no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate (\\u{ord(text[e.start]):04x}) at {e.start}, not valid "
                         "Unicode text") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_encodable)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    """What every generation request carries; ``to_sampling_params`` checks what the schema cannot (the served
    model's name, this server's limits, parameters it does not support) and returns the engine's parameters."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    stop: Text | list[Text] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict | None = None
    user: StrictStr | None = None

    def to_sampling_params(self, served: str, max_tokens_limit: int) -> SamplingParams:
        return self._params(served, max_tokens_limit, self.max_tokens)

    def _params(self, served: str, limit: int, max_tokens: int | None, logprobs: int | None = None,
                echo: bool = False) -> SamplingParams:
        if self.model != served:
            raise APIError(404, f"The model '{self.model}' does not exist (served: '{served}')", "model",
                           "model_not_found")
        unsupported = [("n", self.n != 1), ("presence_penalty", self.presence_penalty != 0),
                       ("frequency_penalty", self.frequency_penalty != 0), ("logit_bias", bool(self.logit_bias))]
        for name, bad in unsupported:
            if bad:
                raise APIError(400, f"{name}: not supported by bdlora serve (use the default)", name, "unsupported")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only with stream=true", "stream_options", "unsupported")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise APIError(400, f"temperature {self.temperature}: must be 0 (greedy) or at least {MIN_TEMPERATURE}",
                           "temperature", "invalid_value")
        mt = 16 if max_tokens is None else max_tokens
        least = 0 if echo else 1  # with echo, max_tokens 0 only scores the prompt
        if not least <= mt <= limit:
            raise APIError(400, f"max_tokens {mt}: must be >= {least}{'' if echo else ' (0 only with echo)'}"
                           if mt < least else f"max_tokens {mt}: above this server's limit of {limit}",
                           "max_tokens", "invalid_value")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise APIError(400, f"stop: at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters",
                           "stop", "invalid_value")
        return SamplingParams(max_tokens=mt, temperature=float(self.temperature), top_p=float(self.top_p),
                              stop=tuple(stop), seed=self.seed, logprobs=logprobs, echo=echo)


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def to_sampling_params(self, served: str, max_tokens_limit: int) -> SamplingParams:
        for name, bad in (("best_of", self.best_of not in (None, 1)), ("suffix", self.suffix is not None)):
            if bad:
                raise APIError(400, f"{name}: not supported by bdlora serve", name, "unsupported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs {self.logprobs}: must be in [0, {MAX_LOGPROBS}]", "logprobs",
                           "invalid_value")
        if self.stream and (self.echo or self.logprobs is not None):
            raise APIError(400, "echo and logprobs: supported without stream only", "stream", "unsupported")
        return self._params(served, max_tokens_limit, self.max_tokens, self.logprobs, self.echo)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Text
    name: StrictStr | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    def to_sampling_params(self, served: str, max_tokens_limit: int) -> SamplingParams:
        if self.logprobs or self.top_logprobs is not None:
            raise APIError(400, "logprobs: not supported by bdlora serve", "logprobs", "unsupported")
        if not self.messages:
            raise APIError(400, "messages: empty list", "messages", "invalid_value")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(served, max_tokens_limit, limit)


# ------------------------------------------------------------------------------------------------------------------
# Responses
# ------------------------------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(BaseModel):
    index: int = 0
    logprobs: dict | None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    id: str
    created: int
    model: str


class CompletionChoice(_Choice):
    text: str


class CompletionResponse(_Response):
    """A whole completion, and (with ``usage`` None) each streamed chunk of one."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Choice):
    message: AssistantMessage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(_Choice):
    delta: dict


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "bdlora"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class APIError(Exception):
    """An error answered to the client with OpenAI's error body and ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def error_body(message: str, type_: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
