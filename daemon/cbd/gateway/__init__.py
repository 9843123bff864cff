"""The OpenAI-compatible HTTP gateway: the Chat Completions and Completions APIs over the cbd.v1 contract.

A separate process (`cbd openai`), a client of the daemon's gRPC contract like any other: it imports
`cbd_client` and its own modules only, never the engine or the server. Installed with the `openai` extra
(Starlette + uvicorn). Files: errors.py (gRPC status -> HTTP error bodies), requests.py (an API request
-> GenerateRequest), replies.py (Generate streams -> API objects and server-sent events), sessions.py
(the session extension), app.py (routes), main.py (the command line). The agent APIs: responses/
(OpenAI Responses), messages/ (Anthropic Messages), agentic/ (what both share: callers, turns on resident
sessions, output blocks).
"""
