"""The per-step context every attention layer reads, so model forwards stay (input_ids, positions)."""
from dataclasses import dataclass

from asynct.attention.base import AttentionMetadata


@dataclass
class Context:
    attn_metadata: AttentionMetadata | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(metadata: AttentionMetadata | None):
    _CONTEXT.attn_metadata = metadata


def reset_context():
    set_context(None)
