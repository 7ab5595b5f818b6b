#!/usr/bin/env python3
"""Write a tiny Qwen2 model directory that a real vLLM can serve on CPU.

    python3 scripts/make_tiny_model.py OUTDIR
    python3 scripts/make_tiny_model.py --weights OUTDIR

The directory has a config, a byte-level BPE tokenizer trained here from
generated text, a ChatML chat template and a generation config. Without
--weights it has no weights: serve it with `--load-format dummy` (random
weights whose near-uniform logits make every greedy step a near tie). With
--weights it also has model.safetensors, seeded random weights scaled so that
greedy decoding has clear margins, as a trained model's has: serve it without
--load-format. Nothing is downloaded, and the same OUTDIR contents come out on
every run.

Shape choices, and why:
- head_dim 64 (hidden 256 / 4 heads): vLLM's CPU attention path kills the
  engine with smaller heads.
- float32, served with `--dtype float32`: vLLM's bfloat16 path on CPU picks
  its kernels by the CPU's features (AVX-512 BF16, AMX, or emulation), so a
  bfloat16 model is served by different code on different hosts; float32 takes
  the same path on every x86-64 CPU.
- 2 layers x 1 KV head x head_dim 64 in float32 gives exactly 1024 bytes of
  KV cache per token (2 x 2 x 1 x 64 x 4), so KV sizes map to token counts
  with plain powers of two.
- The vocabulary is a multiple of 64 and every id in it is a real token, so a
  randomly sampled id always decodes.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

VOCAB_SIZE = 2048  # a multiple of 64
HIDDEN_SIZE = 256
NUM_HEADS = 4
NUM_KV_HEADS = 1
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 512
MAX_POSITIONS = 4096
DTYPE = "float32"
DTYPE_BYTES = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
KV_BYTES_PER_TOKEN = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES

# --weights: every matrix N(0, WEIGHT_STD), as a trained model's initializer
# leaves it, except the two ends. The final RMSNorm hands lm_head a vector of
# RMS 1 (norm 16 at hidden 256), so lm_head rows of standard deviation
# LM_HEAD_STD give logits of standard deviation about 16 x LM_HEAD_STD; the gap
# between the two largest of 2048 such logits, the greedy margin, is then
# mostly a few nats. Embeddings of standard deviation EMBED_STD keep the
# current token's identity strong in the residual stream, as in a trained model.
WEIGHTS_FILE = "model.safetensors"
WEIGHT_SEED = 3090
WEIGHT_STD = 0.02
EMBED_STD = 1.0
LM_HEAD_STD = 0.7

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SYLLABLES = (
    "ka ro mi te su na lo ve di an er in on th st re ou ly ing ed al ar or ex pre "
    "qu ze fu bo ga hi ju ke wa yo co nt ur im ul ra se ti pe ma de go "
).split()
_WORDS = (
    "the a of and to in is that for it on with as was be by at this from or are "
    "model server token cache memory card process engine request stream health "
    "restart alert metric block queue python vllm watchdog kernel driver signal "
    "hello world please answer question quickly slowly today tomorrow yes no"
).split()


def corpus(seed: int = 3090, lines: int = 6000) -> list[str]:
    """Deterministic pseudo-text: common words, made-up words, numbers, punctuation, code-ish lines."""
    rng = random.Random(seed)
    made_up = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(800)]
    out = []
    for i in range(lines):
        kind = i % 5
        words = [rng.choice(_WORDS if rng.random() < 0.6 else made_up) for _ in range(rng.randint(4, 18))]
        if kind == 0:
            words[0] = words[0].capitalize()
            out.append(" ".join(words) + rng.choice(".?!"))
        elif kind == 1:
            out.append(", ".join(words) + f" {rng.randint(0, 99999)}.")
        elif kind == 2:
            out.append(f"{words[0]}_{words[1]} = {rng.randint(0, 4096)}  # {' '.join(words[2:])}")
        elif kind == 3:
            out.append(f"{IM_START}user\n{' '.join(words)}{IM_END}\n{IM_START}assistant\n{' '.join(reversed(words))}{IM_END}")
        else:
            out.append("\t" + " ".join(w.upper() if rng.random() < 0.1 else w for w in words) + "\n")
    return out


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    # Fill up to VOCAB_SIZE so that no id the model can emit is unknown to the tokenizer.
    missing = VOCAB_SIZE - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {size} tokens, expected {VOCAB_SIZE}")
    return tok


def weight_shapes() -> dict[str, tuple[int, ...]]:
    """Qwen2ForCausalLM's tensors by their checkpoint names (vLLM's and transformers' loaders read these)."""
    q, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN_SIZE,),
            p + "self_attn.q_proj.weight": (q, HIDDEN_SIZE),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, HIDDEN_SIZE),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, HIDDEN_SIZE),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (HIDDEN_SIZE, q),
            p + "post_attention_layernorm.weight": (HIDDEN_SIZE,),
            p + "mlp.gate_proj.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
            p + "mlp.up_proj.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
            p + "mlp.down_proj.weight": (HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
    shapes |= {"model.norm.weight": (HIDDEN_SIZE,), "lm_head.weight": (VOCAB_SIZE, HIDDEN_SIZE)}
    return shapes


def seeded_weights(seed: int = WEIGHT_SEED) -> dict:
    """name -> float32 array: norms 1, biases 0, embeddings and lm_head scaled (see LM_HEAD_STD), the rest N(0, WEIGHT_STD).

    Each tensor has its own generator, seeded from `seed` and its name, so a
    tensor does not change when another is added or reshaped."""
    import zlib

    import numpy as np

    out = {}
    for name, shape in weight_shapes().items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, dtype=np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, dtype=np.float32)
        else:
            std = {"model.embed_tokens.weight": EMBED_STD, "lm_head.weight": LM_HEAD_STD}.get(name, WEIGHT_STD)
            rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)
    return out


def write_model(outdir: Path, weights: bool = False, seed: int = WEIGHT_SEED) -> None:
    """Write into a sibling temporary directory, then swap it in: an interrupted run leaves no half model."""
    outdir = outdir.resolve()
    staging = outdir.with_name(outdir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_files(staging)
    if weights:
        from safetensors.numpy import save_file

        save_file(seeded_weights(seed), str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / WEIGHTS_FILE).chmod(0o644)  # written owner-only; the service user reads it like the rest
    if outdir.exists():
        shutil.rmtree(outdir)
    staging.rename(outdir)


def _write_files(outdir: Path) -> None:
    tok = train_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok.save(str(outdir / "tokenizer.json"), pretty=True)

    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": NUM_LAYERS,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": DTYPE,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
    }
    added = [
        {"id": tok.token_to_id(t), "content": t, "special": True, "lstrip": False, "rstrip": False,
         "normalized": False, "single_word": False}
        for t in SPECIAL_TOKENS
    ]  # fmt: skip
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_POSITIONS,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": [IM_START, IM_END],
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {"eos_token": IM_END, "pad_token": ENDOFTEXT, "additional_special_tokens": [IM_START, IM_END]}
    generation_config = {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
        "do_sample": False,
    }
    for name, data in (
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
        ("generation_config.json", generation_config),
    ):
        (outdir / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--weights", action="store_true",
                        help=f"also write {WEIGHTS_FILE}: seeded weights with clear greedy margins (serve without --load-format dummy)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=WEIGHT_SEED, help=f"seed of the weights (default {WEIGHT_SEED})")
    args = parser.parse_args(argv)
    needed = ["tokenizers", *(["numpy", "safetensors"] if args.weights else [])]
    for package in needed:
        try:
            __import__(package)
        except ImportError:
            print(f"make_tiny_model: the '{package}' package is missing (pip install {package})", file=sys.stderr)
            return 69  # EX_UNAVAILABLE
    try:
        write_model(args.outdir, weights=args.weights, seed=args.seed)
    except OSError as exc:
        print(f"make_tiny_model: cannot write {args.outdir}: {exc.strerror}", file=sys.stderr)
        return 73  # EX_CANTCREAT
    kind = f"seeded weights (seed {args.seed})" if args.weights else "no weights: serve with --load-format dummy"
    print(f"tiny Qwen2 model written to {args.outdir} (vocab {VOCAB_SIZE}, {DTYPE}, {KV_BYTES_PER_TOKEN} KV bytes per token, {kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
