"""A grammar compile worker process: compiles specs one at a time and answers with their serialized form.

Started by ipc/grammar_pool.py with one end of a socket pair (argv[1], a file descriptor). Messages are
pickled by multiprocessing's Connection: first the setup (the tokenizer's xgrammar info as JSON, the
vocabulary size, the stop tokens, the memory budget in bytes), answered with "ready"; then one
`(kind, source)` per compile, answered with `("ok", serialized)` or `("invalid", message)`. The address
space it may grow by past its state after setup is capped (RLIMIT_AS); an allocation beyond it fails
(answered "memory", then the worker exits) or kills the process, which the pool reads as the same.
The pool kills a worker whose compile runs past its time budget or whose request was cancelled.
"""

from __future__ import annotations

import resource
import sys
from multiprocessing.connection import Connection

from cbd.lifetime import die_with_parent

_PAGE = 4096


def _address_space() -> int:
    """Bytes of address space this process maps now."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * _PAGE


def main(fd: int) -> int:
    die_with_parent()
    conn = Connection(fd)
    info_json, vocab_size, stop_token_ids, memory_bytes = conn.recv()
    import xgrammar as xgr

    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec
    from cbd.errors import InvalidRequest

    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = GrammarCompiler(None, vocab_size, tuple(stop_token_ids), cache_size=1, info=info, max_threads=1)
    limit = _address_space() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send("ready")
    while True:
        try:
            kind, source = conn.recv()
        except EOFError:  # the pool closed its end
            return 0
        try:
            compiled = compiler.compile(GrammarSpec(GrammarKind(kind), source))
            answer = ("ok", compiled.compiled.serialize_json())
        except InvalidRequest as exc:
            answer = ("memory", "") if "bad_alloc" in str(exc) else ("invalid", str(exc))
        except (MemoryError, RuntimeError):  # past its address space (xgrammar raises std::bad_alloc)
            answer = ("memory", "")
        conn.send(answer)
        if answer[0] == "memory":  # the library's state after a failed allocation is not trusted
            return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
