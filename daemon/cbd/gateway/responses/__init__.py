"""The OpenAI Responses API (/v1/responses) over resident cbd sessions.

items.py: input items <-> chat messages and the output items; request.py: a create body -> a planned
turn; store.py: stored responses (SQLite) and which of them is the latest turn of its session;
stream.py: the typed streaming events; background.py: responses that run on after the call answered;
routes.py: create, retrieve, delete, cancel, input_items.
"""
