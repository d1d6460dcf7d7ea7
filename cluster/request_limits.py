"""What one request may ask of the front end and the scheduler: every per-request size is bounded."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.scheduler.checks import check_positive_ints

DEFAULT_MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_CACHE_SALT_BYTES = 256
DEFAULT_MAX_PROMPT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request bounds, each refused with ``INVALID_ARGUMENT`` (HTTP 400) naming it.

    ``max_prompt_tokens`` ``None``: the model's ``max_model_len`` alone bounds prompts.
    The request message's size is ``ServerConfig.max_message_bytes``.
    """

    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_cache_salt_bytes: int = DEFAULT_MAX_CACHE_SALT_BYTES
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_stop_token_ids", "max_cache_salt_bytes", "max_prompt_bytes", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            check_positive_ints(**{name: value})
