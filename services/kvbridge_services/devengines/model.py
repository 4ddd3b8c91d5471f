"""A random-weight Llama and a WordLevel tokenizer built locally (no hub access).

The model is only for exercising the serving path (KV layout, P/D transfer,
greedy determinism); its outputs are meaningless but reproducible for a seed.
Run as a script to build one: ``python -m kvbridge_services.devengines.model OUT_DIR``.
Needs torch, transformers and tokenizers (installed with vLLM); imported only when building.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

# Special tokens first so their ids are stable: 0..3.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

# A minimal chat template: "<role> : <content> " lines, then "assistant : " when asked; tool definitions and an
# assistant's tool calls are rendered too (a "tools : <names>" line; " call <name> <arguments>" after the content),
# so that tool-calling histories reach the engines as the tokens they are.
CHAT_TEMPLATE = (
    "{% if tools %}tools :{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %} \n{% endif %}"
    "{% for message in messages %}{{ message['role'] }} : "
    "{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %} call {{ call['function']['name'] }}"
    " {{ call['function']['arguments'] }}{% endfor %} \n{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """Shape of the generated model. Defaults: the 2-layer toy for functional tests."""

    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    seed: int = 1234
    dtype: str = "float32"  # on-disk weights; engines pick their own --dtype

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V bytes per token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


TINY = ModelShape()
# A bench shape: GQA, 12+ layers, hidden >= 1024 so prefill compute per KV byte is realistic.
BENCH = ModelShape(
    num_layers=16,
    hidden_size=1024,
    num_attention_heads=16,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=3072,
    vocab_size=512,
    dtype="bfloat16",
)
# The README demo's shape (``kvbridge demo``): big enough that a full prefill of a 1,500-token agent context
# costs visibly more than pulling its KV (about 1.5 ms of prefill per token on one core of the 2-core dev VM),
# small enough that both engines start and the whole demo runs within minutes. fp32, like the engines.
DEMO = ModelShape(
    num_layers=8,
    hidden_size=768,
    num_attention_heads=12,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=2048,
    vocab_size=512,
)
SHAPES = {"tiny": TINY, "demo": DEMO, "bench": BENCH}


def _vocabulary(vocab_size: int) -> dict[str, int]:
    words = [*SPECIAL_TOKENS, "user", "assistant", "system", ":"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    return {word: index for index, word in enumerate(words)}


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Save a whitespace WordLevel tokenizer (fast tokenizer files) into out_dir."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(WordLevel(vocab=_vocabulary(vocab_size), unk_token="<unk>"))
    raw.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))


def build_model(out_dir: Path, shape: ModelShape) -> None:
    """Save a random-weight LlamaForCausalLM (safetensors) into out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        dtype=shape.dtype,
    )
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    # A larger init spread than the default makes greedy outputs vary with the prompt
    # (with std 0.02 a tiny random model tends to emit one token forever).
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.5 / shape.hidden_size**0.5 * 4)
    model = model.to(getattr(torch, shape.dtype))
    model.save_pretrained(str(out_dir), safe_serialization=True)


def build(out_dir: Path, shape: ModelShape = TINY) -> Path:
    """Build model + tokenizer into out_dir (idempotent: reuses a finished build)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / "kvbridge_shape.json"
    wanted = json.dumps(asdict(shape), sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return out_dir
    build_tokenizer(out_dir, shape.vocab_size)
    build_model(out_dir, shape)
    marker.write_text(wanted)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--bench", action="store_true", help="build the bench shape instead of the toy")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="model shape: tiny (default, 2 layers), demo (8 layers, hidden 768) or bench",
    )
    args = parser.parse_args(argv)
    print(build(args.out_dir, SHAPES[args.shape or ("bench" if args.bench else "tiny")]))


if __name__ == "__main__":
    main()
