"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) over resident cbd sessions.

request.py: a Messages body -> chat messages and a GenerateRequest template; conversations.py: live
sessions found by the conversation they hold (clients resend the whole conversation each call);
routes.py: the routes, whole and streamed replies, and errors in the API's shape.
"""
