"""Request bodies of the chat route and /tokenize (which renders messages as the chat route does):
messages, tools and the chat template's options; the sampling fields are protocol.py's."""
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from asynct.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from asynct.entrypoints.chat_utils import template_message
from asynct.entrypoints.serve.protocol import STRICT, Body, SamplingFields, Unsupported, _or


class TextPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None
    refusal: str | None = None      # an assistant's {"type": "refusal", "refusal": ...}


class ChatMessage(BaseModel):
    model_config = {**STRICT, "extra": "allow"}     # tool_calls, name, ...: passed to the template
    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict:
        """As LLM.chat renders it; ValueError where it cannot be."""
        return template_message(self.model_dump(exclude_none=True))


class FunctionDefinition(BaseModel):
    model_config = {**STRICT, "extra": "allow"}     # strict, ...: passed to the template
    name: str
    description: str | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class ChatTemplateFields(Body):
    """How messages are rendered: the chat route's, and /tokenize's so that its count is the route's."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False      # vLLM's: the last message stays open, to be continued
    chat_template: str | None = None          # vLLM's: in place of the server's (trusted servers only)
    chat_template_kwargs: dict | None = None
    tools: list[Tool] | None = None       # rendered by the chat template, as LLM.chat's
    documents: list[dict] | None = None   # vLLM's: for a template that takes them (RAG)

    def template_kwargs(self) -> dict:
        """chat_template_kwargs, with the request's chat_template where it has one (the kwargs' wins)."""
        kwargs = self.chat_template_kwargs or {}
        return kwargs if self.chat_template is None else {"chat_template": self.chat_template, **kwargs}


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    echo: bool = False        # vLLM's: the answer starts with the last message, where it continues it
    add_special_tokens: bool = False      # vLLM's: the template writes BOS itself
    NULL_IS_DEFAULT: ClassVar[tuple] = ("n", "stream", "logprobs", "return_token_ids")

    def api_param(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"logprobs": "top_logprobs", "prompt": "messages"}.get(field, field)

    @property
    def requested_max_tokens(self) -> int | None:
        return _or(self.max_completion_tokens, self.max_tokens)

    def to_params(self, defaults: dict | None = None, max_logprobs: int = MAX_LOGPROBS) -> SamplingParams:
        self._check_tool_choice()
        if self.top_logprobs and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.requested_max_tokens, k, self.prompt_logprobs_k(max_logprobs), defaults,
                                    max_logprobs)

    @property
    def response_role(self) -> str:
        """As vLLM: the assistant's, or without a generation prompt the last message's (the
        template continues it)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed(self) -> str:
        """What echo puts in front of the answer: as vLLM, the last message's content where the
        answer is of its role (always, without a generation prompt: the template continues it)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.for_template().get("content") or ""

    def _check_tool_choice(self):
        """As vLLM without --enable-auto-tool-choice: tools are only rendered (tool_choice "none"), as
        asynct has no tool call parser to return the model's calls as `tool_calls`, nor guided
        decoding to force one; a client told "auto" works would read a call as plain content."""
        # as vLLM: "auto" is the default only where the field is absent; sent as null it is "none"
        default = "auto" if self.tools and "tool_choice" not in self.model_fields_set else "none"
        choice = self.tool_choice if self.tool_choice is not None else default
        if choice == "none":
            return
        if not self.tools:
            raise Unsupported("tool_choice", "tool_choice needs tools")
        name = "naming a function" if isinstance(choice, dict) else repr(choice)
        if self.tool_choice is None:
            name += " (the default with tools)"
        raise Unsupported("tool_choice", f"tool_choice {name} is not supported: asynct has no tool call parser "
                                         "(vLLM's --enable-auto-tool-choice); send tool_choice 'none' to have the "
                                         "chat template render the tools and the answer come as text")


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)    # as the chat route's
    add_special_tokens: bool | None = None       # unset: as the route that takes them (special_tokens)
    return_token_strs: bool = False

    @property
    def special_tokens(self) -> bool:
        """As vLLM's two tokenize bodies, so that a count equals the route's prompt_tokens: a
        prompt gets them as /v1/completions (true), messages as chat (false: the template has BOS)."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None
