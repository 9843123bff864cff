"""What the agent APIs (Responses in responses/, Messages in messages/) share: who the caller is
(caller.py), starting a turn on a resident session with its fallbacks (turns.py), continuing the sessions
of clients that resend whole conversations (resends.py, over the index in conversations.py; Chat
Completions uses it too), and a Generate stream
folded into output blocks — text and tool calls — with the events both APIs stream (blocks.py)."""
