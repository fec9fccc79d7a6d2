"""OpenAI's Responses API (``/v1/responses``): a shape layer over the chat pipeline.

``protocol`` holds the request shapes (input items, tools, ``text.format``), ``convert``
turns a request into a chat turn (messages, tools, ``response_format``), ``objects`` the
response shapes, ``writer`` builds the response and its stream events from the chat
pipeline's events, ``store`` keeps stored responses for ``previous_response_id`` and
``routes`` serves ``POST``/``GET``/``DELETE /v1/responses``. Validation, tools,
structured outputs and the engine stream are the chat pipeline's, written once.
"""
