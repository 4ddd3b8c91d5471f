"""The gateway's per-turn work that grows with the prompt, in-process: a warm conversation's next turn.

    .venv/bin/python bench/prompt_steps.py --out bench/results/prompt_steps

For each prompt size, a conversation's first turn is encoded (the dev HF tokenizer + chat template, as the
gateway's local tokenizer), then each later turn appends an assistant answer and a user message and times the
steps the router runs before the prefill: JSON parse of the body, the prompt's ids (``LocalTokenizers.ids``,
resuming the previous encoding), the hash chain (``ChainCache.chain``, extending the previous chain) and the
prefix digest P checks (``hashchain.prefix_digest``). The ids come as the tokenizer's ``array("I")``; the same
chain and digest are also timed on a list of the same ids (how the ids were passed before they stayed packed),
and so is building that list. Best of ``--repeat`` per turn, median over turns. Writes <out>.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbridge import hashchain  # noqa: E402
from kvbridge_services.devengines.model import build_tokenizer  # noqa: E402
from kvbridge_services.gateway.chaincache import ChainCache, Scope  # noqa: E402
from kvbridge_services.gateway.tokenizer import LocalTokenizers  # noqa: E402

SECRET = b"s" * 32
BLOCK = 16
STEPS = ("parse", "ids", "chain", "digest", "list of ids", "chain (list)", "digest (list)")


def best_ms(repeat: int, fn: Callable[..., Any], *args: Any) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


async def one_size(tokenizer_dir: Path, words: int, turns: int, repeat: int) -> dict[str, float]:
    tokenizers = LocalTokenizers({"m": tokenizer_dir})
    scope, key = Scope("t", "m", "", BLOCK), ("t", "c")
    chains, list_chains = ChainCache(SECRET, max_bytes=1 << 30), ChainCache(SECRET, max_bytes=1 << 30)
    msgs: list[dict[str, str]] = [{"role": "user", "content": " ".join(f"w{i % 400 + 10}" for i in range(words))}]
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    tokens = 0
    try:
        for turn in range(turns + 1):
            raw = orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 8, "conversation_id": "c"})
            parse_ms = best_ms(repeat, orjson.loads, raw)
            body = orjson.loads(raw)
            started = time.perf_counter()
            ids = await tokenizers.ids("m", "chat", body, key)
            ids_ms = (time.perf_counter() - started) * 1e3
            assert ids is not None
            tokens, as_list = len(ids), list(ids)
            k = (len(ids) - 1) // BLOCK * BLOCK
            if turn > 0:  # turn 0 encodes and hashes the whole prompt: not a warm turn
                times["parse"].append(parse_ms)
                times["ids"].append(ids_ms)
                times["chain"].append(best_ms(repeat, chains.chain, scope, "c", ids))
                times["digest"].append(best_ms(repeat, hashchain.prefix_digest, ids, k))
                times["list of ids"].append(best_ms(repeat, list, ids))
                times["chain (list)"].append(best_ms(repeat, list_chains.chain, scope, "c", as_list))
                times["digest (list)"].append(best_ms(repeat, hashchain.prefix_digest, as_list, k))
            else:
                chains.chain(scope, "c", ids)
                list_chains.chain(scope, "c", as_list)
            msgs = [
                *msgs,
                {"role": "assistant", "content": "w1 w2 w3 w4 w5 w6 w7 w8"},
                {"role": "user", "content": f"w{turn + 11} w20 and tell me more about it"},
            ]
    finally:
        tokenizers.close()
    out = {s: statistics.median(v) for s, v in times.items()}
    out["tokens"] = float(tokens)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--words", default="6000,24000,60000,120000", help="first prompt sizes (1 word: 1 token)")
    p.add_argument("--turns", type=int, default=8, help="warm turns timed per size")
    p.add_argument("--repeat", type=int, default=20, help="best of this many runs per step (ids: one run)")
    p.add_argument("--out", type=Path, default=Path("/tmp/prompt_steps"))
    args = p.parse_args()
    tokenizer_dir = Path(tempfile.mkdtemp()) / "tokenizer"
    tokenizer_dir.mkdir()
    build_tokenizer(tokenizer_dir, 512)
    rows = []
    for words in (int(w) for w in args.words.split(",")):
        print(f"{words} words ...", flush=True)
        rows.append(asyncio.run(one_size(tokenizer_dir, words, args.turns, args.repeat)))
    command = "python bench/prompt_steps.py " + " ".join(sys.argv[1:])
    lines = [
        "# The gateway's per-turn work that grows with the prompt (in-process, warm conversation)",
        "",
        f"Command: `{command}`",
        "",
        "Median over warm turns of each step's time in ms (best of the repeats); ids resume the previous "
        "turn's encoding, the chain extends the previous turn's chain. The `(list)` columns pass the same ids "
        "as a Python list instead of the tokenizer's array (how they were passed before they stayed packed); "
        "`list of ids` is building that list.",
        "",
        "| prompt tokens | " + " | ".join(STEPS) + " |",
        "| ---: | " + " | ".join("---:" for _ in STEPS) + " |",
    ]
    for r in rows:
        lines.append(f"| {r['tokens']:,.0f} | " + " | ".join(f"{r[s]:.3f}" for s in STEPS) + " |")
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()
