"""cbd-client: talk to a running cbd daemon from a terminal.

    cbd-client "What is the capital of France?"      one-shot: stream the answer (chat template)
    cbd-client --raw "Once upon a time"              one-shot with plain text instead of chat
    cbd-client chat                                  interactive multi-turn chat (Ctrl-D to quit); also
                                                     what `cbd-client` with no arguments does
    cbd-client info | stats                          model information / live statistics

The answer goes to stdout, messages (waiting for the daemon, errors) to stderr. Exit status: 0, or 1 with one
line on stderr when a call fails (no daemon, invalid input, ...), 2 for bad command-line usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from cbd_client.client import Client
from cbd_client.errors import CbdError, invalid_argument


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "stop": args.stop or None,
    }  # fmt: skip
    if args.json_schema:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                values["response_format"] = {"type": "json_schema", "json_schema": json.load(f)}
        except (OSError, ValueError) as exc:
            raise invalid_argument(f"--json-schema {args.json_schema}: {exc}") from None
    return values


def _stream_answer(client: Client, prompt, args: argparse.Namespace) -> str:
    if args.n > 1:  # candidates interleave: print each whole once all are done
        result = client.generate(prompt, n=args.n, **_sampling(args))
        for c in result.candidates:
            print(f"[{c.index}] ({c.finish_reason}) {c.text}")
        return result.text
    text = []
    for delta in client.stream(prompt, **_sampling(args)):
        print(delta.text, end="", flush=True)
        text.append(delta.text)
    print()
    return "".join(text)


def _chat(client: Client, args: argparse.Namespace) -> None:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        print("cbd> ", end="", flush=True)
        messages.append({"role": "assistant", "content": _stream_answer(client, messages, args)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cbd-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt", nargs="*", help="a prompt, or one of: chat, info, stats")
    parser.add_argument(
        "--address", help="unix:/path or host:port (default: $CBD_ADDRESS or the daemon's default socket)"
    )
    parser.add_argument("--token", default=os.environ.get("CBD_TOKEN"),
                        help="the bearer token of a daemon started with --auth-token-file (default: $CBD_TOKEN)")  # fmt: skip
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, not as a chat message")
    parser.add_argument("--system", help="a system message for chat prompts")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", help="a stop string (repeatable)")
    parser.add_argument("-n", type=int, default=1, help="number of candidates")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="a JSON schema file: the answer is JSON valid under it (constrained decoding)")  # fmt: skip
    parser.add_argument("--wait", type=float, default=120.0,
                        help="seconds to wait for a daemon that is still loading its model (default 120); with no "
                             "daemon at the address (no socket file, connection refused) the client fails at once")  # fmt: skip
    args = parser.parse_args(argv)
    if args.n < 1:  # one line, status 1, as every other bad value
        print(f"cbd-client: INVALID_ARGUMENT: n must be at least 1, got {args.n}", file=sys.stderr)
        return 1
    try:
        with Client(args.address, token=args.token) as client:
            client.wait_ready(args.wait, on_wait=lambda message: print(f"cbd-client: {message}", file=sys.stderr))
            command = args.prompt[0] if len(args.prompt) == 1 else None
            if command in ("info", "stats"):
                result = client.model_info() if command == "info" else client.stats()
                print(json.dumps(dataclasses.asdict(result), indent=2))
            elif command == "chat" or not args.prompt:
                _chat(client, args)
            else:
                text = " ".join(args.prompt)
                messages = [{"role": "system", "content": args.system}] if args.system else []
                _stream_answer(client, text if args.raw else messages + [{"role": "user", "content": text}], args)
    except CbdError as e:
        print(f"cbd-client: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`)
        return 141
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
