"""The engine process and its frontend: typed messages over two local sockets.

The daemon runs as two processes. The engine process owns the model, the device, the overlap loop and
the tensor-parallel ranks (endpoint.py serves an `Engine` there); the frontend process runs the gRPC
server and talks to it through `RemoteEngine` (remote.py), which has the engine's API. wire.py holds
every message that crosses, text.py the detokenisation that the frontend does for the engine.
"""
