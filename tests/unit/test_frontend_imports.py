"""The frontend process imports no torch (nor xgrammar, which imports torch): its entry and what it
imports are torch-free, so its start and memory are those of a gRPC server. Checked in a fresh
interpreter, since this test process has torch loaded already."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TEXT = "Hello  wörld\n\tdef f(x): return x**2 <|im_end|>"
CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u \U0001f642"}]


def test_the_frontend_entry_imports_no_torch() -> None:
    code = "import sys, cbd.server.app; print(sorted(m for m in ('torch', 'xgrammar') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.slow
def test_a_generic_tokenizer_loads_as_autotokenizer_would_without_torch() -> None:
    """The embedded model's tokenizer (a Llama's, its config naming the generic fast class) loads as the same
    class with the same vocabulary, specials, chat template and encodings as AutoTokenizer's, in a process
    that never imports torch."""
    code = (
        (
            "import sys, json\n"
            "from pathlib import Path\n"
            "from cbd.model.files import load_tokenizer, loads_generic_tokenizer\n"
            "d = Path(sys.argv[1])\n"
            "t = load_tokenizer(d)\n"
            "print(json.dumps([loads_generic_tokenizer(d), type(t).__name__, 'torch' in sys.modules, t.get_vocab(),\n"
            "    t.all_special_ids, t.eos_token_id, t.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),\n"
            "    t.encode(TEXT)]))\n"
        )
        .replace("TEXT", repr(TEXT))
        .replace("CHAT", repr(CHAT))
    )
    from transformers import AutoTokenizer

    from cbd.model.loader import resolve_checkpoint

    directory = resolve_checkpoint(None)  # the converted GGUF file, as the engine process tells the frontend
    out = subprocess.run(
        [sys.executable, "-c", code, str(directory)], capture_output=True, text=True, check=True, timeout=300
    )
    generic, cls, torch_loaded, *facts = json.loads(out.stdout)
    assert generic and not torch_loaded, out.stderr
    auto = AutoTokenizer.from_pretrained(directory)
    assert cls == type(auto).__name__
    assert facts == [
        auto.get_vocab(), auto.all_special_ids, auto.eos_token_id,
        auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True), auto.encode(TEXT),
    ]  # fmt: skip


@pytest.mark.slow
def test_a_model_type_whose_tokenizer_class_autotokenizer_swaps_keeps_autotokenizer(tmp_path: Path) -> None:
    """Qwen2's config with the generic class named: AutoTokenizer builds Qwen2's own class (it normalises
    text to NFC), and so does load_tokenizer."""
    from transformers import AutoTokenizer

    from cbd.model.files import load_tokenizer, loads_generic_tokenizer
    from cbd.model.loader import resolve_checkpoint

    source = resolve_checkpoint(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    ours, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert not loads_generic_tokenizer(tmp_path)
    assert type(ours) is type(auto) and type(auto).__name__ != "TokenizersBackend"
    assert ours.encode("cafe\u0301 " + TEXT) == auto.encode("cafe\u0301 " + TEXT)
