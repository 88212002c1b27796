"""Random-weight Llama checkpoints made locally, for tests and benchmarks.

vLLM loads a model from a directory; nothing here downloads anything. The weights are random
(seeded, so greedy outputs repeat), which is all a KV-cache test needs: the KV bytes and the
greedy tokens are a deterministic function of the prompt. A small word-level tokenizer is
saved beside the weights so ``vllm serve`` starts normally; prompts given as token ids need
none.

Two shapes are named: :data:`TINY` (fast engine start, for tests) and :data:`BENCH` (about
100M parameters, 16 KiB of KV per token in bf16: prefill costs real time on a CPU).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ModelShape", "TINY", "BENCH", "make_random_llama"]


@dataclass(frozen=True)
class ModelShape:
    """The geometry of a random Llama."""

    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 1024
    max_positions: int = 4096
    dtype: str = "bfloat16"
    seed: int = 0
    init_std: float = 0.3
    """Weight scale: well above transformers' 0.02, so greedy tokens depend on the whole
    context (with tiny weights a random model repeats one token whatever the prompt, and
    wrong KV would go unnoticed)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


TINY = ModelShape()
BENCH = ModelShape(num_layers=8, hidden_size=1024, num_heads=8, num_kv_heads=4,
                   intermediate_size=4096, vocab_size=8192, max_positions=8192)

_STAMP = "kvstrata-random-model.json"


def make_random_llama(directory: str | os.PathLike, shape: ModelShape = TINY) -> Path:
    """Write a random-weight Llama of ``shape`` (config, safetensors weights, tokenizer) into
    ``directory`` and return it. A directory already holding the same shape is reused."""
    out = Path(directory)
    stamp = out / _STAMP
    wanted = asdict(shape)
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == wanted:
                return out
        except (OSError, ValueError):
            pass
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                         intermediate_size=shape.intermediate_size,
                         num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads,
                         num_key_value_heads=shape.num_kv_heads,
                         max_position_embeddings=shape.max_positions,
                         bos_token_id=1, eos_token_id=2, initializer_range=shape.init_std, tie_word_embeddings=False,
                         torch_dtype=shape.dtype)
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype))
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out, shape.vocab_size)
    stamp.write_text(json.dumps(wanted))
    return out


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose words are ``t0 .. t{vocab-1}``: text ``"t5 t17"`` is
    token ids ``[5, 17]`` (id 0 is ``<unk>``), so HTTP clients can send text prompts too."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t1",
                                   eos_token="t2")
    fast.save_pretrained(out)
