"""Chat templates as vLLM takes them: `--chat-template` is a file or the template itself, and
`LLM.chat` renders conversations with the tokenizer's template (or one given)."""
import json
from pathlib import Path

JINJA_CHARS = "{}\n"      # vLLM's test: a template has these, a file name has not


def load_chat_template(template: str | None) -> str | None:
    """The template a `--chat-template` value names: the file's text where it is a file, else
    the value itself where it looks like a Jinja template; ValueError otherwise."""
    if template is None:
        return None
    path = Path(template)
    if not any(c in template for c in JINJA_CHARS):
        try:
            return path.read_text()
        except OSError as e:
            raise ValueError(f"the chat template {template!r} looks like a file path, but it cannot be "
                             f"read: {e.strerror or e}") from None
    return template


def render_conversations(tokenizer, conversations, chat_template=None, add_generation_prompt=True,
                         continue_final_message=False, tools=None, chat_template_kwargs=None) -> list[str]:
    """Each conversation (a list of {"role", "content"} messages) as its prompt text."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer, so LLM.chat cannot render messages: "
                         "use LLM.generate with prompt_token_ids")
    kwargs = _template_kwargs(chat_template_kwargs)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template: pass chat_template='...' (a Jinja template) "
                         "or use LLM.generate with a prompt")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    bad = next((c for c in conversations if not isinstance(c, (list, tuple))), None)
    if bad is not None:
        raise ValueError(f"a conversation is a list of messages, got {type(bad).__name__}")
    texts = []
    for i, conv in enumerate(conversations):
        messages = [template_message(m) for m in conv]
        try:
            # as vLLM's LLM.chat: the call's own arguments win over chat_template_kwargs
            texts.append(tokenizer.apply_chat_template(messages, **{
                **kwargs, "chat_template": template, "tokenize": False, "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message, **({} if tools is None else {"tools": tools})}))
        except Exception as e:   # Jinja's own (raise_exception, a bad role), as the server's 400 says it
            raise ValueError(f"the chat template failed on conversation {i}: {type(e).__name__}: {e}") from e
    return texts


def _template_kwargs(kwargs) -> dict:
    """chat_template_kwargs, checked: the template's variables by name. The messages are
    LLM.chat's own: a `messages` there was a TypeError reported as "the chat template failed"."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs is a dict of the template's variables by name, got {kwargs!r:.60}")
    if {"messages", "conversation"} & set(kwargs):
        raise ValueError("chat_template_kwargs may not set the messages: they are LLM.chat's first argument")
    return kwargs


def template_message(message: dict) -> dict:
    """An OpenAI message as vLLM hands it to a chat template; ValueError where it cannot."""
    _check_message(message)
    return _tool_arguments_as_dicts(_parts_as_text(message))


def _check_message(message):
    """The shape the server's ChatMessage takes, for LLM.chat's messages too: a string in place
    of a message was an AttributeError ('str' object has no attribute 'get') from deep inside."""
    if not isinstance(message, dict):
        raise ValueError(f'a message is a dict {{"role": ..., "content": ...}}, got {type(message).__name__}')
    if not isinstance(message.get("role"), str):
        raise ValueError(f"a message's role is a string, got {message.get('role')!r:.40}")
    if not isinstance(message.get("content"), (str, list, type(None))):
        raise ValueError(f"a message's content is a string or a list of text parts, got "
                         f"{type(message['content']).__name__}")


# the content parts vLLM reads as text, and the key that holds it: OpenAI's text, an assistant's
# refusal (the openai client's typed assistant content), the Responses API's input and output text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _parts_as_text(message: dict) -> dict:
    """OpenAI's content parts [{"type": "text", "text": ...}, ...] become one string, a part a
    line, as vLLM joins them for a template that takes content as a string."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [_part_text(p) for p in content]
        if any(t is None for t in texts):
            raise ValueError("only text content parts ({\"type\": \"text\", \"text\": \"...\"}, or an "
                             "assistant's refusal) are supported")
        return {**message, "content": "\n".join(texts)}
    return message


def _part_text(part) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else None
    text = part.get(TEXT_PARTS[kind]) if isinstance(kind, str) and kind in TEXT_PARTS else None
    return text if isinstance(text, str) else None


def _tool_arguments_as_dicts(message: dict) -> dict:
    """OpenAI sends an assistant's tool call arguments as a JSON string; tool-use templates (and
    vLLM, which parses them) take a dict: `arguments|items` fails on a string, `tojson` quotes it."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    if not calls:        # an empty list would take a template's tool-call branch
        return {k: v for k, v in message.items() if k != "tool_calls"}
    return {**message, "tool_calls": [_parsed_call(c) for c in calls]}


def _parsed_call(call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ValueError('a tool call is {"type": "function", "function": {"name": ..., "arguments": ...}}')
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call arguments are not JSON: {e}") from None
    return {**call, "function": {**function, "arguments": arguments}}
