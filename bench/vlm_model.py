"""The vision benchmark's model: a random-weight SmolVLM-256M-shaped Idefics3 (SigLIP tower of 12 layers,
hidden 768, 16-pixel patches on 512-pixel tiles, pixel shuffle by 4 into 64 rows a tile; SmolLM2-135M's
text decoder: 30 layers, hidden 576, 9 heads, 3 KV heads), saved with transformers and converted by the
llama-cpp-python sdist's ``convert_hf_to_gguf.py`` into a text GGUF and its ``--mmproj`` projector.
Cached under the test-model cache; the first build takes a minute or two.

    .venv/bin/python bench/vlm_model.py     # build (if needed) and print the three paths
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fixtures.gguf_convert import llama_cpp_source  # noqa: E402
from tests.fixtures.models import CACHE, _staging, smollm2_tokenizer_dir  # noqa: E402

# SmolVLM-Instruct's chat template and the tokens SmolVLM adds to SmolLM2's vocabulary
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
VERSION = 1
NAME = f"vlm-smolvlm256m-bench-v{VERSION}"
TILE, PATCH, SCALE = 512, 16, 4


def _build(target: str) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.eos_token = "<end_of_utterance>"
    config = Idefics3Config(
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=TILE, patch_size=PATCH),
        text_config=dict(model_type="llama", architectures=["VLlama3ForCausalLM"],  # (as SmolVLM's config says)
                         vocab_size=len(tok), hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, bos_token_id=1,
                         eos_token_id=tok.convert_tokens_to_ids("<end_of_utterance>"), rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
        scale_factor=SCALE, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 4 * TILE}, max_image_size={"longest_edge": TILE})
    processor = Idefics3Processor(image_processor, tok, image_seq_len=(TILE // PATCH // SCALE) ** 2,
                                  chat_template=CHAT_TEMPLATE)
    model.save_pretrained(target, safe_serialization=True)
    processor.save_pretrained(target)


def _convert(source: Path, out: Path, mmproj: bool) -> None:
    tree = llama_cpp_source()
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
    argv = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(source), "--outfile", str(out),
            "--outtype", "f16", *(["--mmproj"] if mmproj else [])]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {source}:\n{done.stderr[-4000:]}")


def bench_vlm() -> tuple[Path, Path, Path]:
    """(safetensors folder, text GGUF, mmproj GGUF), built and converted once."""
    target = CACHE / NAME
    hf, text, mmproj = target / "hf", target / "gguf" / "smolvlm-256m.f16.gguf", \
        target / "gguf" / "mmproj-smolvlm-256m.f16.gguf"
    if not (hf / "config.json").exists():
        with _staging(hf) as tmp:
            _build(tmp)
    if not (text.is_file() and mmproj.is_file()):
        with _staging(text.parent) as tmp:
            _convert(hf, Path(tmp) / text.name, mmproj=False)
            _convert(hf, Path(tmp) / mmproj.name, mmproj=True)
            made = [p for p in Path(tmp).glob("*.gguf") if p.name != text.name]
            if not (Path(tmp) / mmproj.name).is_file() and len(made) == 1:
                made[0].rename(Path(tmp) / mmproj.name)  # (the converter may prefix the name with mmproj-)
    return hf, text, mmproj


if __name__ == "__main__":
    for p in bench_vlm():
        print(p)
