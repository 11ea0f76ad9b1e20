"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``): the body put in chat's shape
(`request`), answered as a ``message`` or its typed event stream (`messages`)."""
