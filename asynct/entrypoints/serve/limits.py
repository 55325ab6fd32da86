"""`ServerLimits`: no serving imports here, so that `asynct serve --help` shows the defaults
without the serving extras installed."""
from dataclasses import dataclass


@dataclass
class ServerLimits:
    """What one request may ask for, and how long the server waits on a client (docs/serving.md)."""
    max_n: int = 128                          # OpenAI's cap
    max_choices: int = 4096                   # prompts x n of one request: the server's loop works per choice
    max_prompt_chars: int | None = None       # None: the most that max_model_len tokens can spell
    trust_request_chat_template: bool = False
    render_timeout: float = 10.0              # seconds to render a chat template or tokenise
    header_timeout: float = 10.0              # seconds for a request's headers to arrive
    keep_alive_timeout: int = 5               # seconds an idle connection stays open
    max_connections: int = 2048               # open connections; more are closed at once
    max_stop_strings: int = 16                # each one is searched for in every new token of every choice
    max_logprobs: int = 20                    # vLLM's default; -1: the vocabulary

