"""Sessions: the records (branches, retention, ids), the session table and its turns, and which idle
session leaves the GPU first. Uses kv/ for blocks and the host tier; never the core or the threaded engine."""
