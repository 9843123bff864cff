"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) over resident cbd sessions.

request.py: a Messages body -> chat messages and a GenerateRequest template (the sessions of resent
conversations are found by agentic/resends.py); routes.py: the routes, whole and streamed replies, and errors in the API's shape.
"""
