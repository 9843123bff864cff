"""The frontend process imports no torch (nor xgrammar, which imports torch): its entry and what it
imports are torch-free, so its start and memory are those of a gRPC server. Checked in a fresh
interpreter, since this test process has torch loaded already."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_frontend_entry_imports_no_torch() -> None:
    code = "import sys, cbd.server.app; print(sorted(m for m in ('torch', 'xgrammar') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_generic_tokenizer_loads_as_autotokenizer_would_without_torch() -> None:
    """The embedded model's tokenizer (its config names the generic fast class) loads as the same class with
    the same vocabulary, specials and chat template as AutoTokenizer's, in a process that never imports torch."""
    code = (
        "import sys, json\n"
        "from pathlib import Path\n"
        "from cbd.model.files import load_tokenizer, tokenizer_class\n"
        "d = Path(sys.argv[1])\n"
        "t = load_tokenizer(d)\n"
        "chat = [{'role': 'system', 'content': 's'}, {'role': 'user', 'content': 'u \U0001f642'}]\n"
        "print(json.dumps([tokenizer_class(d), type(t).__name__, 'torch' in sys.modules, t.get_vocab(),\n"
        "    t.all_special_ids, t.eos_token_id, t.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),\n"
        "    t.encode('Hello  wörld\\n\\tdef f(x): return x**2 <|im_end|>')]))\n"
    )
    from transformers import AutoTokenizer

    from cbd.model.loader import resolve_checkpoint

    directory = resolve_checkpoint(None)  # the converted GGUF file, as the engine process tells the frontend
    out = subprocess.run(
        [sys.executable, "-c", code, str(directory)], capture_output=True, text=True, check=True, timeout=300
    )
    name, cls, torch_loaded, *facts = json.loads(out.stdout)
    assert name == "TokenizersBackend" and not torch_loaded, (name, out.stderr)
    auto = AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u \U0001f642"}]
    assert cls == type(auto).__name__
    assert facts == [
        auto.get_vocab(), auto.all_special_ids, auto.eos_token_id,
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        auto.encode("Hello  wörld\n\tdef f(x): return x**2 <|im_end|>"),
    ]  # fmt: skip
