"""What the agent APIs (Responses in responses/, Messages in messages/) share: who the caller is
(caller.py), starting a turn on a resident session with its fallbacks (turns.py), and a Generate stream
folded into output blocks — text and tool calls — with the events both APIs stream (blocks.py)."""
