"""Random-weight checkpoints made locally, for tests and benchmarks: a Llama, and for the
attention types the connector holds besides full attention a Gemma-3-style model (sliding
window and full layers interleaved) and a DeepSeek-V2-style one (MLA).

vLLM loads a model from a directory; nothing here downloads anything. The weights are random
(seeded, so greedy outputs repeat), which is all a KV-cache test needs: the KV bytes and the
greedy tokens are a deterministic function of the prompt. A small word-level tokenizer is
saved beside the weights so ``vllm serve`` starts normally; prompts given as token ids need
none.

Two shapes are named: :data:`TINY` (fast engine start, for tests) and :data:`BENCH` (about
100M parameters, 16 KiB of KV per token in bf16: prefill costs real time on a CPU).
:func:`make_random_model` makes any of :data:`ARCHITECTURES` of a shape.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["ModelShape", "TINY", "BENCH", "ARCHITECTURES", "make_random_llama",
           "make_random_model"]

ARCHITECTURES = ("llama", "gemma3", "deepseek_v2", "qwen3_next")
"""``llama``: full attention; ``gemma3``: sliding-window layers with one full-attention layer
in four (Gemma 3's pattern is five in six), window :attr:`ModelShape.sliding_window`;
``deepseek_v2``: MLA, dense layers (vLLM's CPU MLA kernel needs a latent of 512 + 64);
``qwen3_next``: linear-attention (Gated DeltaNet, a Mamba-style state in vLLM) and
full-attention layers alternating, one MoE layer (vLLM's model needs one; its CPU kernels
need linear heads of 128)."""


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
    sliding_window: int = 64
    """Tokens each sliding-window layer attends to (``gemma3``)."""
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
    return make_random_model(directory, shape, "llama")


def make_random_model(directory: str | os.PathLike, shape: ModelShape = TINY,
                      architecture: str = "llama") -> Path:
    """Write a random-weight model of ``architecture`` (one of :data:`ARCHITECTURES`) and
    ``shape`` into ``directory`` and return it; a directory already holding the same one is
    reused."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    out = Path(directory)
    stamp = out / _STAMP
    wanted = {**asdict(shape), "architecture": architecture}
    if architecture == "llama":
        wanted.pop("architecture")           # stamps written before there was a choice
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == wanted:
                return out
        except (OSError, ValueError):
            pass
    import torch

    out.mkdir(parents=True, exist_ok=True)
    config, model_class = _BUILDERS[architecture](shape)
    torch.manual_seed(shape.seed)
    model = model_class(config).to(getattr(torch, shape.dtype))
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out, shape.vocab_size)
    stamp.write_text(json.dumps(wanted))
    return out


def _common(shape: ModelShape) -> dict:
    return dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                intermediate_size=shape.intermediate_size,
                num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                num_key_value_heads=shape.num_kv_heads,
                max_position_embeddings=shape.max_positions, bos_token_id=1, eos_token_id=2,
                initializer_range=shape.init_std, torch_dtype=shape.dtype)


def _llama(shape: ModelShape):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig(**_common(shape), tie_word_embeddings=False), LlamaForCausalLM


def _gemma3(shape: ModelShape):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["full_attention" if i % 4 == 3 or i == shape.num_layers - 1
                   else "sliding_attention"
                   for i in range(shape.num_layers)]
    config = Gemma3TextConfig(**_common(shape), head_dim=shape.head_dim,
                              sliding_window=shape.sliding_window,
                              query_pre_attn_scalar=shape.head_dim, layer_types=layer_types,
                              pad_token_id=0)
    config.architectures = ["Gemma3ForCausalLM"]
    return config, Gemma3ForCausalLM


def _deepseek_v2(shape: ModelShape):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    common = _common(shape)
    common["num_key_value_heads"] = shape.num_heads
    config = DeepseekV2Config(**common, kv_lora_rank=512, q_lora_rank=None,
                              qk_nope_head_dim=shape.head_dim, qk_rope_head_dim=64,
                              v_head_dim=shape.head_dim,
                              first_k_dense_replace=shape.num_layers,    # no MoE layer
                              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                              moe_intermediate_size=32)
    config.architectures = ["DeepseekV2ForCausalLM"]
    return config, DeepseekV2ForCausalLM


def _qwen3_next(shape: ModelShape):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    layer_types = ["full_attention" if i % 2 else "linear_attention"
                   for i in range(shape.num_layers)]
    config = Qwen3NextConfig(**_common(shape), head_dim=shape.head_dim, layer_types=layer_types,
                             linear_conv_kernel_dim=4, linear_key_head_dim=128,
                             linear_value_head_dim=128, linear_num_key_heads=1,
                             linear_num_value_heads=1,
                             mlp_only_layers=list(range(shape.num_layers - 1)), num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, pad_token_id=0)
    config.architectures = ["Qwen3NextForCausalLM"]
    return config, Qwen3NextForCausalLM


_BUILDERS = {"llama": _llama, "gemma3": _gemma3, "deepseek_v2": _deepseek_v2,
             "qwen3_next": _qwen3_next}


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
