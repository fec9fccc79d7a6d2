"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): a
shape layer over the chat pipeline the OpenAI routes use.

``protocol`` holds the request models, ``convert`` turns a request into a chat turn,
``blocks`` turns the pipeline's events into content blocks (the whole message and the
stream share it), ``sse`` writes the stream's events, ``errors`` gives Anthropic's
error body, and ``routes`` registers the handlers.
"""
