"""The engine process and its frontend: the engine's API (engine/api.py) over two local sockets.

The daemon runs as two processes. The engine process owns the model, the device, the overlap loop and
the tensor-parallel ranks (endpoint.py serves an `Engine` there); the frontend process runs the gRPC
server and talks to it through `RemoteEngine` (remote.py), which has the engine's API. channel.py makes
the sockets (and removes their directory), engine_process.py supervises the process, frontend_requests.py
is the frontend's registry of live requests and calls, text.py the detokenisation the frontend does for
the engine. Nothing here imports torch on the frontend's side.
"""
