"""Constrained decoding with xgrammar: grammars compiled once per spec, one matcher per constrained sequence.

Why xgrammar: it compiles JSON schemas, regexes, EBNF grammars and structural tags (free text with
triggered, schema-constrained tool calls) to a token-level automaton with a precomputed mask cache, so
filling one sequence's next-token bitmask takes microseconds on the host; its matchers roll back (drafts
are checked and masked without moving the state); and it applies a batch of bitmasks to logits on the CPU
or the GPU. Every candidate of a fan-out has its own state of the request's one compiled grammar.

Threads: `GrammarCompiler.compile` and `load` are thread-safe and are called off the engine thread (the
request waits, not the batch). In the daemon, `compile` runs only in the frontend's compile workers
(ipc/grammar_pool.py), and the engine process `load`s the serialized result (ipc/grammar_loads.py). The
cache is keyed by the spec's text, so a repeated schema or tool set costs a lookup; it is bounded by count
and by bytes (MAX_CACHED_GRAMMAR_BYTES), so distinct large grammars cannot grow the process. A compiled grammar
whose language is empty (no first token allowed) is refused. A `GrammarState` belongs to one sequence
and is used only by the engine thread.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from cbd.engine.grammar.schema_check import load_schema
from cbd.engine.grammar.tag_formats import JSON_SEPARATORS, expand
from cbd.errors import InvalidRequest

if TYPE_CHECKING:  # tensors only pass through here: the frontend imports this module without torch
    import torch

MAX_GRAMMAR_BYTES = 64 * 1024  # a schema, regex, grammar or tool set larger than this is refused
MAX_CACHED_GRAMMAR_BYTES = 256 * 2**20  # compiled grammars kept at most (xgrammar's own size estimate)


class GrammarKind(Enum):
    JSON_SCHEMA = "json_schema"  # source: a JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; source unused
    REGEX = "regex"
    GRAMMAR = "grammar"  # EBNF in xgrammar's dialect (GBNF-like), root rule `root`
    STRUCTURAL_TAG = "structural_tag"  # xgrammar structural tag, as JSON text (tool calls)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.source.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(f"{self.kind.value} is {len(self.source.encode())} bytes; at most {MAX_GRAMMAR_BYTES}")


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Any:
    """xgrammar's TokenizerInfo of a transformers tokenizer (what every compile reads; seconds to build)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


class GrammarCompiler:
    """Compiles specs against the served tokenizer; a bounded LRU of compiled grammars."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...], cache_size: int = 256,
        encoded_vocab: list[bytes] | None = None, info: Any = None, max_threads: int = 2,
    ) -> None:  # fmt: skip
        """tokenizer: a transformers tokenizer; or None with encoded_vocab, each token's bytes (tests), or
        with info, an xgrammar TokenizerInfo made already (compile workers)."""
        import xgrammar as xgr

        self._xgr = xgr
        stops = list(stop_token_ids)
        if info is not None:
            self.info = info
        elif tokenizer is None:
            if encoded_vocab is None:
                raise ValueError("a grammar compiler needs a tokenizer or an encoded vocabulary")
            self.info = xgr.TokenizerInfo(encoded_vocab, vocab_size=vocab_size, stop_token_ids=stops)
        else:
            self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, tuple[Any, int]] = OrderedDict()  # spec -> (compiled, bytes)
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self.cached_bytes = 0
        self.vocab_size = vocab_size

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return CompiledGrammar(spec, hit[0])
        compiled = self._compile(spec)  # outside the lock: two different specs compile at once
        self._remember(spec, compiled)
        return CompiledGrammar(spec, compiled)

    def load(self, spec: GrammarSpec, serialized: str) -> CompiledGrammar:
        """A grammar compiled elsewhere (a compile worker, see ipc/grammar_pool.py) from its serialized
        form, cached by spec like a compile. Deserializing releases the interpreter lock."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return CompiledGrammar(spec, hit[0])
        compiled = self._xgr.CompiledGrammar.deserialize_json(serialized, self.info)
        self._remember(spec, compiled)
        return CompiledGrammar(spec, compiled)

    def _remember(self, spec: GrammarSpec, compiled: Any) -> None:
        """Cache `compiled`, dropping the least recently used past the count or the byte bound."""
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if spec in self._cache:
                return
            self._cache[spec] = (compiled, size)
            self.cached_bytes += size
            while len(self._cache) > self._cache_size or (
                self.cached_bytes > MAX_CACHED_GRAMMAR_BYTES and len(self._cache) > 1
            ):
                _, (_, dropped) = self._cache.popitem(last=False)
                self.cached_bytes -= dropped

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def _compile(self, spec: GrammarSpec) -> Any:
        compiled = self._compile_spec(spec)
        matcher = self._xgr.GrammarMatcher(compiled)
        mask = self.new_bitmask(1)
        matcher.fill_next_token_bitmask(mask)
        if not bool(mask.any()):  # no first token is allowed, not even the stop token: nothing can match
            raise InvalidRequest(f"the {spec.kind.value} matches nothing (its language is empty)")
        return compiled

    def _compile_spec(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        try:
            if spec.kind is GrammarKind.JSON_OBJECT:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS)
            if spec.kind is GrammarKind.JSON_SCHEMA:
                load_schema(spec.source, "json_schema")  # refuses keywords the grammar would not enforce
                return c.compile_json_schema(spec.source, any_whitespace=False, separators=JSON_SEPARATORS)
            if spec.kind is GrammarKind.REGEX:
                check_anchors(spec.source)
                return c.compile_regex(spec.source)
            if spec.kind is GrammarKind.GRAMMAR:
                return c.compile_grammar(spec.source)
            return c.compile_structural_tag(expand(spec.source))
        except InvalidRequest:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequest(f"invalid {spec.kind.value}: {_first_line(exc)}") from None

    def new_bitmask(self, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32, every token allowed."""
        bitmask = self._xgr.allocate_token_bitmask(rows, self.vocab_size)
        return bitmask.to(device) if str(device) != "cpu" else bitmask


NO_TOKENIZER = "structured output and tools need a tokenizer, and this checkpoint has none"


class LazyGrammarCompiler:
    """A GrammarCompiler made on first use (building the tokenizer's info takes seconds), thread-safe."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarCompiler:
        """Raises InvalidRequest for a model without a tokenizer."""
        with self._lock:
            if self._compiler is None:
                if self._args[0] is None:
                    raise InvalidRequest(NO_TOKENIZER)
                self._compiler = GrammarCompiler(*self._args)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises InvalidRequest for a spec the grammar library rejects, or a model without a tokenizer."""
        return self.get().compile(spec)

    def load(self, spec: GrammarSpec, serialized: str) -> CompiledGrammar:
        return self.get().load(spec, serialized)

    @property
    def cached_bytes(self) -> int:
        """Bytes of compiled grammars in the cache (0 before the compiler is made)."""
        compiler = self._compiler
        return compiler.cached_bytes if compiler is not None else 0

    def cached(self, spec: GrammarSpec) -> bool:
        """Whether `spec` is in the cache (False before the compiler is made; never makes it)."""
        with self._lock:
            compiler = self._compiler
        return compiler is not None and compiler.cached(spec)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    spec: GrammarSpec
    compiled: Any  # xgrammar's CompiledGrammar; None in the frontend, which holds only `serialized`
    serialized: str | None = None  # xgrammar's JSON form, which crosses to the engine process

    def new_state(self) -> GrammarState:
        if self.compiled is None:
            raise ValueError("a serialized grammar is loaded by the engine process (GrammarCompiler.load) first")
        return GrammarState(self)


class GrammarState:
    """One sequence's position in its grammar: advanced by every sampled token, read for the next mask.
    Drafts (speculative decoding) are checked against it and get masks from it without moving it."""

    __slots__ = ("grammar", "_matcher", "num_accepted", "slow_steps")

    def __init__(self, grammar: CompiledGrammar) -> None:
        import xgrammar as xgr

        self.grammar = grammar
        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self.num_accepted = 0
        self.slow_steps = 0  # consecutive steps whose mask took longer than its budget

    def over_budget(self, seconds: float, budget: float) -> int:
        """Record one step's mask fill time; how many consecutive steps have been over `budget` so far."""
        self.slow_steps = self.slow_steps + 1 if seconds > budget else 0
        return self.slow_steps

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar rejects it (never for a masked sample)."""
        ok = bool(self._matcher.accept_token(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may follow."""
        return bool(self._matcher.is_terminated())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts) the grammar accepts in a row without reaching its end (the
        token that ends it is left to be sampled); the state is unchanged afterwards."""
        count = 0
        for token in tokens:
            if not self._matcher.accept_token(token):
                break
            count += 1
            if self._matcher.is_terminated():
                self._matcher.rollback(count)
                return count - 1
        if count:
            self._matcher.rollback(count)
        return count

    def fill_drafted(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Masks for a verifying step's rows: `row` as now, `row + 1 + i` after drafts[: i + 1] (drafts that
        valid_prefix accepted); the state is unchanged afterwards."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        for i, token in enumerate(drafts):
            if not self._matcher.accept_token(token):
                raise AssertionError(f"a draft the grammar refuses: {token}")  # valid_prefix let it through
            self._matcher.fill_next_token_bitmask(bitmask, row + 1 + i)
        if drafts:
            self._matcher.rollback(len(drafts))


def _first_line(exc: Exception) -> str:
    """The library's message without its log prefix ("[12:00:00] /path/file.cc:42: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", text)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf in place. logits: [B, V]; bitmask: [B or len(rows), W]."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


def check_anchors(regex: str) -> None:
    """The reply matches a regex as a whole, and the compiler drops `^` and `$` wherever they stand: an anchor
    is refused unless it only restates that (at the start or end of the regex or of an alternative)."""
    i, in_class = 0, False
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            i += 2 if regex[i + 1 : i + 2] == "^" else 1
            i += 1 if regex[i : i + 1] == "]" else 0  # a leading ] is a member of the class
            continue
        elif (ch == "^" and regex[i - 1 : i] not in ("", "(", "|")) or (
            ch == "$" and regex[i + 1 : i + 2] not in ("", ")", "|")
        ):
            raise InvalidRequest("regex: ^ and $ are taken only at the start and end of the regex or of an "
                                 "alternative (the reply matches the regex as a whole)")  # fmt: skip
        i += 1
