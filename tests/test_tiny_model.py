"""The bundled tiny model (`models/pdserve-tiny`, built by scripts/train_tiny_model.py)
loads with plain transformers, generates, renders chats and carries its MTP layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

MODEL_DIR = Path(__file__).parents[1] / "models" / "pdserve-tiny"
MTP_PREFIX = "model.mtp_layers.0."
MTP_KEYS = [
    "hidden_layernorm.weight",
    "token_layernorm.weight",
    "input_proj.weight",
    "final_layernorm.weight",
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").exists(),
    reason="models/pdserve-tiny is missing; build it with scripts/train_tiny_model.py",
)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def test_folder_is_small_enough_to_commit() -> None:
    size = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert size <= 25 * 1024 * 1024, f"{MODEL_DIR} is {size / 2**20:.1f} MiB (limit 25 MiB)"


def test_config(config: dict) -> None:
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] <= 8192


def test_safetensors_has_target_and_mtp_weights(config: dict) -> None:
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
        hidden = config["hidden_size"]
        assert f.get_slice(MTP_PREFIX + "input_proj.weight").get_shape() == [hidden, 2 * hidden]
        assert f.get_slice(MTP_PREFIX + "self_attn.q_proj.weight").get_shape() == \
            f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()
    missing = [MTP_PREFIX + k for k in MTP_KEYS if MTP_PREFIX + k not in keys]
    assert not missing, f"MTP keys missing: {missing}"
    extra_mtp = {k for k in keys if k.startswith("model.mtp_layers.")} - {MTP_PREFIX + k for k in MTP_KEYS}
    assert not extra_mtp, f"unexpected MTP keys: {sorted(extra_mtp)}"
    assert "model.embed_tokens.weight" in keys and "model.norm.weight" in keys
    n_params = 0
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        for k in keys:
            n = 1
            for d in f.get_slice(k).get_shape():
                n *= d
            n_params += n
    assert 3_000_000 <= n_params <= 10_000_000
    assert dtypes == {"BF16"}


def test_tokenizer_special_tokens(tokenizer) -> None:
    assert tokenizer.eos_token == "<|endoftext|>"
    vocab = tokenizer.get_vocab()
    for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok in vocab
        assert tokenizer.encode(tok) == [vocab[tok]], f"{tok} must be a single special token"
    text = "def add(a, b):\n    return a + b\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_generation_config_stops_on_im_end_and_eot(tokenizer) -> None:
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    vocab = tokenizer.get_vocab()
    assert vocab["<|im_end|>"] in eos and vocab["<|endoftext|>"] in eos


def test_chat_template_renders(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is `json`?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nWhat is `json`?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_start|>user\nHi!<|im_end|>\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ids[0] == tokenizer.get_vocab()["<|im_start|>"]


def test_greedy_generation(model, tokenizer) -> None:
    prompt = "import os\n\n\ndef "
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24)
    new = out[0, ids.shape[1]:]
    assert new.numel() == 24
    # greedy is greedy: the first new token is the argmax of the prompt's logits
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert int(new[0]) == int(logits.argmax())
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert text.strip(), "the model should write something"


def test_model_beats_chance_on_python(model, tokenizer) -> None:
    # A trained model is far more certain about the stdlib than a uniform guess.
    text = "def main():\n    parser = argparse.ArgumentParser()\n    args = parser.parse_args()\n"
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert float(loss) < 0.5 * torch.log(torch.tensor(float(model.config.vocab_size)))
