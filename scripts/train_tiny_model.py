#!/usr/bin/env python
"""Train pdserve's bundled tiny model (`models/pdserve-tiny`) from scratch.

Nothing is downloaded: the corpus is the source of the running Python's
standard library plus the English text of `pydoc_data.topics`, so any machine
with the same CPython version rebuilds the same data.  The script

1. collects the corpus and splits it into train / held-out *by file* (stable
   sha256 of the relative path, not Python's randomised ``hash()``),
2. trains a byte-level BPE tokenizer (``tokenizers``) with ChatML special
   tokens and wraps it so ``transformers.AutoTokenizer`` loads it,
3. trains a small ``Qwen2ForCausalLM`` jointly with ONE MiMo-style MTP layer
   (multi-token prediction draft head, used by pdserve for speculative
   decoding; see docs/architecture.md (speculative decoding) and the model card for its semantics),
4. saves everything as bf16 safetensors (MTP weights beside the target's, under
   ``model.mtp_layers.0.``),
5. reloads the saved folder with ``transformers`` and evaluates: held-out
   perplexity vs. a unigram baseline, and MTP draft acceptance on greedy
   generations of the target, and writes the model card and the loss plot.

The step count is fixed (no wall-clock budget) so a run is deterministic given
``--seed`` (and the same CPython stdlib, torch build and thread count).

Reproduce the bundled model (about half an hour on 2 CPU cores)::

    .venv/bin/python scripts/train_tiny_model.py --seed 0

"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG = logging.getLogger("train_tiny_model")

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]

# ChatML, as used by Qwen2: every message is `<|im_start|>{role}\n{content}<|im_end|>\n`;
# `add_generation_prompt` opens an assistant turn.  No default system prompt.  With `tools`, a
# system turn lists them (one JSON object per line inside <tools></tools>) and says how to call
# one: the Hermes `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` format of Qwen2/Qwen3,
# which the server parses back (server/tool_calls.py). Assistant turns with `tool_calls` render
# those blocks; `tool` turns come back as `<tool_response>` in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou can call the functions whose signatures are listed inside <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call one, write its name and arguments as a JSON object inside "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

SYSTEM_PROMPT = "You are a helpful assistant that knows the Python standard library."
MTP_PREFIX = "model.mtp_layers.0."


# --------------------------------------------------------------------------- corpus


@dataclass
class Document:
    """One unit of the corpus; the split is decided per document (= per file)."""

    relpath: str
    text: str


def stable_bucket(relpath: str, buckets: int = 1000) -> int:
    """A machine-independent bucket in [0, buckets) for the train/held-out split."""
    digest = hashlib.sha256(relpath.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % buckets


def is_heldout(relpath: str, heldout_permille: int) -> bool:
    return stable_bucket(relpath) < heldout_permille


SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _read_source(path: Path) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _scrub_specials(text: str) -> str:
    # Raw corpus text must never contain the literal special-token strings,
    # or the tokenizer would turn them into control tokens.
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, tok.replace("|", "| ", 1))
    return text


def collect_corpus() -> list[Document]:
    """Standard-library .py files (no tests, no site-packages, no machine-specific
    sysconfig data, no codec charmap tables) plus every pydoc topic, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[Document] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel_dir = Path(dirpath).relative_to(stdlib)
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in SKIP_DIRS and not (rel_dir == Path(".") and d.startswith("config-"))
        )
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            relpath = (rel_dir / name).as_posix()
            if relpath == "pydoc_data/topics.py":  # used below as English text instead
                continue
            text = _read_source(Path(dirpath) / name)
            if "### Decoding Table" in text:  # generated codec tables: data, not code
                continue
            if text.strip():
                docs.append(Document(relpath, _scrub_specials(text)))
    from pydoc_data.topics import topics

    for key in sorted(topics):
        docs.append(Document(f"pydoc_data/topics/{key}", _scrub_specials(topics[key].strip() + "\n")))
    return docs


def _truncate(text: str, limit: int) -> str:
    """Cut at a paragraph / line boundary below `limit` characters."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    if cut < limit // 2:
        cut = text.rfind("\n", 0, limit)
    if cut < limit // 2:
        cut = limit
    return text[:cut].rstrip()


def _module_name(relpath: str) -> str:
    parts = relpath[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def chat_conversations(train_docs: list[Document]) -> list[list[dict[str, str]]]:
    """Question/answer chats made from the training split: pydoc topics and
    docstrings of modules and public top-level functions/classes.  They teach the
    model the ChatML turn structure and to end its turn with <|im_end|>."""
    convs: list[list[dict[str, str]]] = []

    def add(key: str, questions: list[str], answer: str) -> None:
        bucket = stable_bucket(key)
        msgs = []
        if bucket % 2 == 0:
            msgs.append({"role": "system", "content": SYSTEM_PROMPT})
        msgs.append({"role": "user", "content": questions[bucket % len(questions)]})
        msgs.append({"role": "assistant", "content": answer})
        convs.append(msgs)

    for doc in train_docs:
        if doc.relpath.startswith("pydoc_data/topics/"):
            topic = doc.relpath.rsplit("/", 1)[1]
            add(doc.relpath, [
                f"Explain the Python topic '{topic}'.",
                f"What does the Python language reference say about {topic}?",
                f"Tell me about {topic} in Python.",
            ], _truncate(doc.text.strip(), 3000))
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                tree = ast.parse(doc.text)
            except (SyntaxError, ValueError):
                continue
        module = _module_name(doc.relpath)
        mod_doc = ast.get_docstring(tree)
        if mod_doc and len(mod_doc) >= 40:
            add(doc.relpath, [
                f"What does the Python module `{module}` do?",
                f"Describe the `{module}` module.",
                f"What is `{module}` for?",
            ], _truncate(mod_doc, 1500))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if node.name.startswith("_"):
                continue
            node_doc = ast.get_docstring(node)
            if not node_doc or len(node_doc) < 40:
                continue
            qual = f"{module}.{node.name}"
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            add(f"{doc.relpath}::{node.name}", [
                f"What does `{qual}` do?",
                f"Explain the {kind} `{qual}`.",
                f"How do I use `{qual}`?",
            ], _truncate(node_doc, 1200))
    return convs


# --------------------------------------------------------------------------- tokenizer


# The pre-tokenizer of Qwen2 (split regex, then byte-level without its own regex,
# NFC normalisation).  transformers 5 rebuilds exactly this pipeline around our
# vocab/merges when AutoTokenizer loads a `qwen2` folder, so we train with it:
# `tokenizers` on tokenizer.json, AutoTokenizer and older transformers then all
# produce identical ids.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok, max_len: int):
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=EOT,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def encode_stream(tok, texts: list[str], eot_id: int) -> np.ndarray:
    """Concatenate documents, each followed by <|endoftext|>."""
    chunks = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        chunks.append(np.asarray(enc.ids + [eot_id], dtype=np.int32))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)


# --------------------------------------------------------------------------- MTP layer


class _AttnProjections(nn.Module):
    """Holds q/k/v/o so the state-dict keys are `self_attn.{q,k,v,o}_proj`, as in Qwen2."""

    def __init__(self, hidden: int, n_heads: int, n_kv: int, head_dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden, n_kv * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden, n_kv * head_dim, bias=True)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)


class MTPLayer(nn.Module):
    """MiMo-style multi-token-prediction layer: a fusion of (target hidden, next
    token embedding) followed by one Qwen2 decoder block and a final RMSNorm.

    The attention is written out here (instead of calling transformers'
    Qwen2DecoderLayer) because training the recursive drafts needs custom
    attention masks; `self_check` verifies it equals the stock block."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

        h, eps = config.hidden_size, config.rms_norm_eps
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.n_heads
        self.hidden_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.token_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.self_attn = _AttnProjections(h, self.n_heads, self.n_kv, self.head_dim)
        self.post_attention_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.mlp = Qwen2MLP(config)
        self.final_layernorm = Qwen2RMSNorm(h, eps=eps)

    def init_weights(self, std: float, generator: torch.Generator) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()

    def fuse(self, h: torch.Tensor, tok_emb: torch.Tensor) -> torch.Tensor:
        return self.input_proj(torch.cat([self.hidden_layernorm(h), self.token_layernorm(tok_emb)], dim=-1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

        b, t, _ = x.shape
        xn = self.input_layernorm(x)
        q = self.self_attn.q_proj(xn).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.self_attn.k_proj(xn).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.self_attn.v_proj(xn).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn: [B, heads, T, head_dim] -> MTP hidden state after final_layernorm."""
        b, _, t, _ = attn.shape
        x = x + self.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)


def recursive_mask(t: int, k: int, device=None) -> torch.Tensor:
    """Boolean [T, k*T] mask (True = may attend) for the k-th recursive MTP pass.

    Keys are [pass-1 keys at positions 0..T-1, pass-2 keys, ..., pass-k keys].
    The k-th application at query position j started from the true target
    hidden state at i = j-k+1; at inference its context is the MTP KV of positions
    0..i (from pass 1, i.e. true hidden states) plus one entry from each later
    pass m at position i+m-1 = j-k+m."""
    j = torch.arange(t, device=device)[:, None]
    p = torch.arange(t, device=device)[None, :]
    parts = [p <= j - k + 1]
    for m in range(2, k + 1):
        parts.append(p == j - k + m)
    return torch.cat(parts, dim=1)


def window_mask(t: int, k: int, window: int) -> torch.Tensor:
    """`recursive_mask` for pass k (k = 1: causal), limited as the engine's MTP attention window is:
    a query at position j sees keys at positions > j - window."""
    mask = recursive_mask(t, k) if k > 1 else torch.ones(t, t, dtype=torch.bool).tril()
    j = torch.arange(t)[:, None]
    return mask & (torch.arange(t)[None, :].repeat(1, k) > j - window)


def mtp_passes(mtp: MTPLayer, embed: nn.Embedding, rotary, h: torch.Tensor,
               next_tokens: torch.Tensor, n_passes: int, window: int = 0) -> list[torch.Tensor]:
    """Teacher-forced MTP over a whole sequence, for n_passes recursion depths.

    h: [B, T, H] target final hidden states (after model.norm) for positions 0..T-1.
    next_tokens: [B, T] = x_{j+1}.  Returns one [B, T, H] MTP hidden per pass;
    pass k's output at position j predicts x_{j+2} and, for j >= k-1, equals the
    k-th recursive draft started at position i = j-k+1 whenever the previous
    drafts were right (the only case in which it is ever used)."""
    b, t, _ = h.shape
    positions = torch.arange(t, device=h.device)
    emb = embed(next_tokens) * (positions != 0).to(h.dtype)[None, :, None]
    cos, sin = rotary(h, positions[None])
    outs: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    h_in = h
    for k in range(1, n_passes + 1):
        x = mtp.fuse(h_in, emb)
        q, key, value = mtp.qkv(x, cos, sin)
        keys.append(key)
        values.append(value)
        if window:  # (scripts/distill_mtp.py: the engine's window)
            attn = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                  attn_mask=window_mask(t, k, window), enable_gqa=True)
        elif k == 1:
            attn = F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=True)
        else:
            attn = F.scaled_dot_product_attention(
                q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                attn_mask=recursive_mask(t, k, h.device), enable_gqa=True)
        g = mtp.finish(x, attn)
        outs.append(g)
        h_in = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
    return outs


@torch.no_grad()
def mtp_draft_incremental(mtp: MTPLayer, embed: nn.Embedding, lm_head: nn.Linear, rotary,
                          h: torch.Tensor, tokens: torch.Tensor, i: int, k_drafts: int):
    """Reference of what the engine does at decode time, one sequence, step by step.

    h: [T, H] target final hidden states, tokens: [T'] with x_0..x_{i+1} known.
    Fills an MTP KV cache for positions 0..i from (h_j, x_{j+1}), then drafts
    k_drafts tokens, appending one KV entry per recursive step (position i+s-1
    for draft s) and feeding back the MTP hidden state and its own draft token.
    Returns (draft token ids, per-draft logits).  Plain eager attention, so it is
    an independent check of `mtp_passes`."""
    n_rep = mtp.n_heads // mtp.n_kv
    scale = mtp.head_dim ** -0.5
    pos = torch.arange(i + 1)
    emb = embed(tokens[1: i + 2]) * (pos != 0).float()[:, None]
    x = mtp.fuse(h[: i + 1][None], emb[None])
    cos, sin = rotary(x, pos[None])
    _, k_cache, v_cache = mtp.qkv(x, cos, sin)
    drafts, logits_list = [], []
    g_prev = None
    for s in range(1, k_drafts + 1):
        if s == 1:
            x_q = x[:, i: i + 1]
            p = i
        else:
            p = i + s - 1
            x_q = mtp.fuse(g_prev, embed(torch.tensor([[drafts[-1]]])))
        cos, sin = rotary(x_q, torch.tensor([[p]]))
        q, k_new, v_new = mtp.qkv(x_q, cos, sin)
        if s > 1:
            k_cache = torch.cat([k_cache, k_new], dim=2)
            v_cache = torch.cat([v_cache, v_new], dim=2)
        kk = k_cache.repeat_interleave(n_rep, dim=1)
        vv = v_cache.repeat_interleave(n_rep, dim=1)
        w = torch.softmax((q @ kk.transpose(-1, -2)) * scale, dim=-1)
        g = mtp.finish(x_q, w @ vv)
        logits = lm_head(g)[0, -1]
        drafts.append(int(logits.argmax()))
        logits_list.append(logits)
        g_prev = g
    return drafts, logits_list


# --------------------------------------------------------------------------- training


@dataclass
class History:
    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    mtp: list[list[float]] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    eval_mtp: list[float] = field(default_factory=list)
    # wall seconds, CPU seconds of this process and 1-min load average per
    # stretch of `eval_every` steps: the run is often on a shared machine, and
    # the fastest stretch tells what an uncontended run would take.
    chunk_wall: list[float] = field(default_factory=list)
    chunk_cpu: list[float] = field(default_factory=list)
    chunk_load: list[float] = field(default_factory=list)


def build_model(vocab_size: int, eot_id: int, im_end_id: int, args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
        use_sliding_window=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)  # initialised under the global seed
    mtp = MTPLayer(config)
    gen = torch.Generator().manual_seed(args.seed + 1)
    mtp.init_weights(config.initializer_range, gen)
    return config, model, mtp


def lr_at(step: int, args) -> float:
    warmup = max(10, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def forward_losses(model, mtp, batch: torch.Tensor, n_passes: int):
    """batch: [B, T+2].  Returns (target CE, [MTP CE per pass])."""
    t = batch.shape[1] - 2
    inp = batch[:, :t]
    h = model.model(input_ids=inp).last_hidden_state
    logits = model.lm_head(h)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1: t + 1].reshape(-1))
    # The MTP learns on top of the target: h is detached so the MTP objective
    # cannot trade target quality for draft quality (the shared embedding and
    # lm_head still see the MTP gradient).
    outs = mtp_passes(mtp, model.model.embed_tokens, model.model.rotary_emb, h.detach(),
                      batch[:, 1: t + 1], n_passes)
    labels = batch[:, 2: t + 2]
    mtp_losses = []
    for k, g in enumerate(outs, start=1):
        lg = model.lm_head(g[:, k - 1:])
        mtp_losses.append(F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), labels[:, k - 1:].reshape(-1)))
    return loss, mtp_losses


def heldout_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len+2 tokens (position 0 = window start)."""
    n = min(max_windows, (len(stream) - 2) // seq_len)
    rows = [stream[w * seq_len: w * seq_len + seq_len + 2] for w in range(n)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.no_grad()
def quick_eval(model, mtp, windows: torch.Tensor, batch_size: int) -> tuple[float, float]:
    model.eval()
    tot, tot_mtp = 0.0, 0.0
    for s in range(0, len(windows), batch_size):
        loss, mtp_losses = forward_losses(model, mtp, windows[s: s + batch_size], 1)
        n = len(windows[s: s + batch_size])
        tot += float(loss) * n
        tot_mtp += float(mtp_losses[0]) * n
    model.train()
    return tot / len(windows), tot_mtp / len(windows)


def train(model, mtp, train_stream: np.ndarray, heldout: np.ndarray, args) -> tuple[History, float]:
    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    weights = [args.mtp_weight * (args.mtp_recursive_decay ** k) for k in range(args.mtp_train_depth)]
    data = torch.from_numpy(train_stream.astype(np.int64))
    gen = torch.Generator().manual_seed(args.seed + 2)
    eval_windows = heldout_windows(heldout, args.seq_len, args.quick_eval_windows)
    eval_every = max(1, args.steps // 10)
    hist = History()
    model.train()
    mtp.train()
    t0 = time.time()
    chunk_t, chunk_c = time.time(), time.process_time()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        if step % eval_every == 0:
            if step > 0:
                hist.chunk_wall.append(time.time() - chunk_t)
                hist.chunk_cpu.append(time.process_time() - chunk_c)
                hist.chunk_load.append(os.getloadavg()[0])
            el, em = quick_eval(model, mtp, eval_windows, args.batch_size)
            hist.eval_step.append(step)
            hist.eval_loss.append(el)
            hist.eval_mtp.append(em)
            chunk_t, chunk_c = time.time(), time.process_time()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = torch.randint(0, len(data) - args.seq_len - 2, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s: s + args.seq_len + 2] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            loss, mtp_losses = forward_losses(model, mtp, batch, args.mtp_train_depth)
        total = loss + sum(w * m for w, m in zip(weights, mtp_losses))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        hist.step.append(step)
        hist.loss.append(float(loss.detach()))
        hist.mtp.append([float(m.detach()) for m in mtp_losses])
        bar.set_postfix(loss=f"{hist.loss[-1]:.3f}", mtp=f"{hist.mtp[-1][0]:.3f}",
                        lr=f"{lr_at(step, args):.1e}")
    train_seconds = time.time() - t0
    hist.chunk_wall.append(time.time() - chunk_t)
    hist.chunk_cpu.append(time.process_time() - chunk_c)
    hist.chunk_load.append(os.getloadavg()[0])
    el, em = quick_eval(model, mtp, eval_windows, args.batch_size)
    hist.eval_step.append(args.steps)
    hist.eval_loss.append(el)
    hist.eval_mtp.append(em)
    return hist, train_seconds


# --------------------------------------------------------------------------- saving


def save_model(out: Path, model, mtp, hf_tok, im_end_id: int, eot_id: int) -> None:
    from transformers import GenerationConfig

    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied to model.embed_tokens.weight
            continue
        state[name] = tensor.detach().to(torch.bfloat16).contiguous()
    for name, tensor in mtp.state_dict().items():
        state[MTP_PREFIX + name] = tensor.detach().to(torch.bfloat16).contiguous()
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)

    config = model.config
    config.num_nextn_predict_layers = 1
    config.dtype = torch.bfloat16
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(out)
    # Also write the legacy top-level `rope_theta` for readers that predate
    # transformers 5's `rope_parameters`.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")

    GenerationConfig(
        bos_token_id=eot_id,
        eos_token_id=[im_end_id, eot_id],
        pad_token_id=eot_id,
        do_sample=False,
    ).save_pretrained(out)
    hf_tok.save_pretrained(out, save_jinja_files=False)
    # Name the class AutoTokenizer picks for a qwen2 folder anyway (same pipeline, see above).
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "Qwen2Tokenizer"
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def load_mtp(out: Path, config) -> MTPLayer:
    state = load_file(str(out / "model.safetensors"))
    mtp_state = {k[len(MTP_PREFIX):]: v.float() for k, v in state.items() if k.startswith(MTP_PREFIX)}
    mtp = MTPLayer(config)
    mtp.load_state_dict(mtp_state, strict=True)
    return mtp.eval()


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def eval_perplexity(model, mtp, windows: torch.Tensor, unigram_logp: torch.Tensor, batch_size: int) -> dict:
    nll = nll_mtp = nll_uni = 0.0
    correct = correct_mtp = 0
    n = 0
    for s in range(0, len(windows), batch_size):
        batch = windows[s: s + batch_size]
        t = batch.shape[1] - 2
        h = model.model(input_ids=batch[:, :t]).last_hidden_state
        logits = model.lm_head(h).float()
        targets = batch[:, 1: t + 1]
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == targets).sum())
        nll_uni += float(-unigram_logp[targets].sum())
        g = mtp_passes(mtp, model.model.embed_tokens, model.model.rotary_emb, h, batch[:, 1: t + 1], 1)[0]
        lg = model.lm_head(g).float()
        labels = batch[:, 2: t + 2]
        nll_mtp += float(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), reduction="sum"))
        correct_mtp += int((lg.argmax(-1) == labels).sum())
        n += targets.numel()
    return {
        "tokens": n,
        "loss": nll / n,
        "ppl": math.exp(nll / n),
        "unigram_loss": nll_uni / n,
        "unigram_ppl": math.exp(nll_uni / n),
        "top1": correct / n,
        "mtp_loss": nll_mtp / n,
        "mtp_ppl": math.exp(nll_mtp / n),
        "mtp_top1": correct_mtp / n,
    }


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding with transformers' KV cache (no early stop on EOS)."""
    out = model(input_ids=prompts, use_cache=True)
    cache = out.cache
    seq = prompts
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new_tokens):
        seq = torch.cat([seq, nxt], dim=1)
        if seq.shape[1] == prompts.shape[1] + new_tokens:
            break
        out = model(input_ids=nxt, cache=cache, use_cache=True)
        cache = out.cache
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return seq


@torch.no_grad()
def eval_acceptance(model, mtp, prompts: torch.Tensor, new_tokens: int, depth: int) -> dict:
    """Greedy target generation; at every generated position i (the target has
    just produced x_{i+1}) the MTP drafts d_1..d_depth for x_{i+2}..x_{i+1+depth},
    d_k applied recursively.  Compare with what the target actually produced."""
    seqs = greedy_generate(model, prompts, new_tokens)
    p_len, n_len = prompts.shape[1], seqs.shape[1]
    h = model.model(input_ids=seqs).last_hidden_state
    outs = mtp_passes(mtp, model.model.embed_tokens, model.model.rotary_emb, h[:, :-1], seqs[:, 1:], depth)
    # start positions i: from the last prompt position (draft made together with
    # the first generated token) to the last i whose x_{i+1+depth} exists.
    starts = torch.arange(p_len - 1, n_len - 1 - depth)
    hits = []
    for k, g in enumerate(outs, start=1):
        draft = model.lm_head(g).argmax(-1)  # pass k at position j predicts x_{j+2}
        j = starts + k - 1
        hits.append(draft[:, j] == seqs[:, j + 2])
    cum = torch.ones_like(hits[0])
    res = {"sequences": int(seqs.shape[0]), "prompt_len": p_len, "generated": new_tokens,
           "positions": int(hits[0].numel()), "cumulative": [], "conditional": [], "mean_accept_len": []}
    for k in range(depth):
        prev = cum
        cum = cum & hits[k]
        res["cumulative"].append(float(cum.float().mean()))
        res["conditional"].append(float(cum.sum()) / max(1, int(prev.sum())))
    for k_max in range(1, depth + 1):
        res["mean_accept_len"].append(1.0 + sum(res["cumulative"][:k_max]))
    res["_seqs"] = seqs
    res["_h"] = h
    return res


@torch.no_grad()
def self_check(model, mtp, seqs: torch.Tensor, h: torch.Tensor, depth: int, n_points: int = 6) -> dict:
    """(a) the MTP block equals transformers' Qwen2DecoderLayer with the same weights;
    (b) step-by-step incremental drafting (engine-style KV cache) agrees with the
    teacher-forced masked passes used for training/evaluation."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    cfg = model.config
    block = Qwen2DecoderLayer(cfg, layer_idx=0).eval()
    block_state = {k: v for k, v in mtp.state_dict().items()
                   if not k.startswith(("hidden_layernorm", "token_layernorm", "input_proj", "final_layernorm"))}
    block.load_state_dict(block_state, strict=True)
    seq, hs = seqs[:1], h[:1, :-1]
    t = hs.shape[1]
    pos = torch.arange(t)
    emb = model.model.embed_tokens(seq[:, 1:]) * (pos != 0).float()[None, :, None]
    x = mtp.fuse(hs, emb)
    cos, sin = model.model.rotary_emb(x, pos[None])
    ref = mtp.final_layernorm(block(x, attention_mask=None, position_ids=pos[None], position_embeddings=(cos, sin)))
    ours = mtp_passes(mtp, model.model.embed_tokens, model.model.rotary_emb, hs, seq[:, 1:], depth)
    block_err = float((ref - ours[0]).abs().max())

    max_logit_err = 0.0
    compared = 0
    total_len = seqs.shape[1]
    for b in range(min(2, len(seqs))):
        for i in np.linspace(1, total_len - 2 - depth, n_points).astype(int).tolist():
            drafts, logits = mtp_draft_incremental(
                mtp, model.model.embed_tokens, model.lm_head, model.model.rotary_emb,
                h[b], seqs[b], i, depth)
            ours_b = mtp_passes(mtp, model.model.embed_tokens, model.model.rotary_emb,
                                h[b: b + 1, :-1], seqs[b: b + 1, 1:], depth)
            for k in range(depth):
                lg = model.lm_head(ours_b[k][0, i + k])
                max_logit_err = max(max_logit_err, float((lg - logits[k]).abs().max()))
                compared += 1
                # deeper drafts are only comparable while the previous ones were right
                if drafts[k] != int(seqs[b, i + k + 2]):
                    break
    # (c) no look-ahead: changing token x_m must leave the MTP outputs at
    # positions < m-1 (which predict x_{<m+1}) untouched, for every pass.
    m = t // 2
    seq2 = seq.clone()
    seq2[0, m] = (seq2[0, m] + 1) % cfg.vocab_size
    h2 = model.model(input_ids=seq2[:, :-1]).last_hidden_state
    ours2 = mtp_passes(mtp, model.model.embed_tokens, model.model.rotary_emb, h2, seq2[:, 1:], depth)
    leak = max(float((a[0, : m - 1] - b[0, : m - 1]).abs().max()) for a, b in zip(ours, ours2))
    changed = min(int((a - b).abs().amax(-1)[0].nonzero()[0]) for a, b in zip(ours, ours2))
    return {"block_vs_transformers_max_abs": block_err,
            "incremental_vs_masked_max_logit_abs": max_logit_err, "compared_drafts": compared,
            "lookahead_max_abs": leak, "first_changed_position": changed, "perturbed_token": m}


# --------------------------------------------------------------------------- report


def load_history(folder: Path) -> History | None:
    path = folder / "training_log.json"
    if not path.exists():
        return None
    log = json.loads(path.read_text())
    return History(step=log["step"], loss=log["target_loss"], mtp=log["mtp_loss"],
                   eval_step=log["eval_step"], eval_loss=log["eval_target_loss"],
                   eval_mtp=log["eval_mtp_loss"], chunk_wall=log["chunk_wall_seconds"],
                   chunk_cpu=log["chunk_cpu_seconds"], chunk_load=log["chunk_load_avg"])


def plot_losses(hist: History, path: Path, unigram_loss: float, vocab_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(y: list[float], w: int) -> np.ndarray:
        y = np.asarray(y, dtype=np.float64)
        if len(y) < w or w < 2:
            return y
        kernel = np.ones(w) / w
        head = np.array([y[: i + 1].mean() for i in range(w - 1)])
        return np.concatenate([head, np.convolve(y, kernel, mode="valid")])

    w = max(1, len(hist.step) // 50)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=100)
    ax.plot(hist.step, smooth(hist.loss, w), label="target, train (predicts x_{i+1})", color="C0", lw=1.5)
    mtp = np.asarray(hist.mtp)
    styles = ["-", (0, (4, 2)), (0, (1, 1.5))]
    for k in range(mtp.shape[1]):
        ax.plot(hist.step, smooth(mtp[:, k].tolist(), w), color=f"C{k + 1}", lw=1.2,
                ls=styles[k % len(styles)],
                label=f"MTP depth {k + 1}, train (predicts x_{{i+2}})" + (" (recursive)" if k else ""))
    ax.plot(hist.eval_step, hist.eval_loss, "o", color="C0", ms=5, label="target, held-out")
    ax.plot(hist.eval_step, hist.eval_mtp, "s", color="C1", ms=5, label="MTP depth 1, held-out")
    ax.axhline(unigram_loss, color="grey", ls=":", label="unigram baseline, held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"pdserve-tiny training (train curves: moving average over {w} steps)")
    ax.set_ylim(0, math.log(vocab_size) + 0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def human_count(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def distillation_lines(d: dict | None) -> list[str]:
    """The card's section on `scripts/distill_mtp.py` (the MTP layer fine-tuned on the target's own
    distribution after training), from its entry in training_summary.json."""
    if d is None:
        return []

    def row(name: str, key: str) -> str:
        return (f"| {name} | " + " | ".join(f"{b:.3f} -> {a:.3f}" for b, a in zip(d["before"][key], d["after"][key]))
                + " |")

    return [
        "",
        "## MTP distillation",
        "",
        "After training, `scripts/distill_mtp.py` fine-tunes the MTP layer alone (the target, embedding and",
        "`lm_head` frozen, so the target's weights are unchanged) to minimise KL(p || q): p the target's own",
        "next-token distribution at the position a draft is verified at, restricted to the draft vocabulary",
        "(`draft_vocab.json`) and renormalised, q the layer's draft distribution there, over both recursive",
        "passes, with the engine's MTP attention window. Speculative decoding keeps a sampled draft with",
        "probability sum_x min(p(x), q(x)) and a greedy one when argmax q = argmax p, so a layer trained on",
        "the corpus's tokens (the data's distribution) drafts worse than one trained on the target's.",
        f"`{d['command']}` ({d['seconds'] / 60:.1f} min); on {d['heldout_windows']} held-out windows, teacher-forced,",
        "before -> after, per recursive pass:",
        "",
        "| | pass 1 | pass 2 |",
        "|---|---|---|",
        row("KL(p~ \\|\\| q)", "kl"),
        row("expected acceptance of a sampled draft, sum min(p, q)", "sampled_acceptance"),
        row("greedy agreement, argmax q = argmax p", "greedy_agreement"),
        "",
        "The acceptance tables above are measured on the distilled layer.",
    ]


def write_card(out: Path, info: dict) -> None:
    ppl, acc = info["ppl"], info["acceptance"]
    cfg = info["config"]
    lines = [
        "---",
        "license: psf-2.0",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [qwen2, mtp, tiny, test-model]",
        "---",
        "",
        "# pdserve-tiny",
        "",
        "A tiny `Qwen2ForCausalLM` (with one MiMo-style **MTP** draft layer) trained from scratch by",
        "`scripts/train_tiny_model.py` on text that every Python installation already has. It is the",
        "default model of pdserve and the reference checkpoint of its tests: small enough to commit,",
        "fast on one CPU core, and good enough that greedy output and MTP acceptance mean something.",
        "It is **not** a useful assistant: it writes plausible-looking Python and Python-docs prose.",
        "",
        "## Training data",
        "",
        f"* Source of the CPython {info['python_version']} standard library (`sysconfig.get_paths()[\"stdlib\"]`),",
        "  `*.py` files, excluding `site-packages`, `test`/`tests`/`idle_test` directories, the",
        "  machine-specific `_sysconfigdata*` and `config-*` files and the generated codec charmap",
        "  tables (`### Decoding Table`).",
        "* The English text of `pydoc_data.topics.topics` (the language reference topics), one document",
        "  per topic.",
        "* ChatML chats built from the training split: questions about pydoc topics, module docstrings and",
        "  docstrings of public top-level functions/classes, answered with that text (half with a system",
        "  prompt), so the model has seen the turn structure and the `<|im_end|>` that closes an answer",
        "  (it sometimes stops there; greedy answers often loop until `max_tokens`).",
        "* Split by file: a file/topic is held out when "
        f"`int(sha256(relpath)[:8], 16) % 1000 < {info['heldout_permille']}`",
        f"  ({info['n_heldout_docs']} of {info['n_docs']} documents held out). Training stream:",
        f"  {info['train_tokens']:,} tokens ({info['n_chats']:,} chats included); held-out stream:",
        f"  {info['heldout_tokens']:,} tokens. Documents are separated by `<|endoftext|>`.",
        "",
        "## Tokenizer",
        "",
        f"Byte-level BPE (`tokenizers`), vocabulary {cfg['vocab_size']}, trained on the training split.",
        f"Special tokens: `<|endoftext|>` (id {info['eot_id']}, eos/pad), `<|im_start|>` (id {info['im_start_id']}), "
        f"`<|im_end|>` (id {info['im_end_id']}).",
        "`tokenizer_config.json` holds a ChatML `chat_template`",
        "(`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, `add_generation_prompt` opens",
        "`<|im_start|>assistant\\n`, no default system prompt). `generation_config.json` stops on",
        "`<|im_end|>` and `<|endoftext|>`.",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        "| architecture | `Qwen2ForCausalLM` + 1 MTP layer (`num_nextn_predict_layers: 1`) |",
        f"| hidden / intermediate | {cfg['hidden_size']} / {cfg['intermediate_size']} |",
        f"| layers / heads / KV heads / head dim | {cfg['num_hidden_layers']} / {cfg['num_attention_heads']} / "
        f"{cfg['num_key_value_heads']} / {cfg['hidden_size'] // cfg['num_attention_heads']} |",
        "| RoPE theta / max positions | 10000 / 2048 (trained on windows of "
        f"{info['args']['seq_len']} tokens) |",
        "| embeddings | tied (`lm_head` = `model.embed_tokens`) |",
        f"| parameters, target | {info['params_target']:,} ({human_count(info['params_target'])}) |",
        f"| parameters, MTP layer | {info['params_mtp']:,} ({human_count(info['params_mtp'])}) |",
        f"| parameters, total | {info['params_total']:,} ({human_count(info['params_total'])}) |",
        "| weights | bf16, one `model.safetensors` |",
        "",
        "## Training",
        "",
        f"{info['args']['steps']} steps of AdamW (betas 0.9/0.95, weight decay 0.1 on matrices, peak lr",
        f"{info['args']['lr']}, linear warm-up then cosine to 10 %, grad-clip 1.0), batch",
        f"{info['args']['batch_size']} x {info['args']['seq_len']} tokens sampled uniformly from the training",
        f"stream ({info['args']['steps'] * info['args']['batch_size'] * info['args']['seq_len']:,} tokens seen),",
        f"on CPU with {info['args']['threads']} threads, fp32 master weights"
        + (" and bf16 autocast for the forward/backward" if info["args"]["autocast"] else " (no autocast)")
        + ". Loss:",
        "",
        "    loss = CE(target, x_{i+1}) + sum_k w_k * CE(MTP pass k, x_{i+2})",
        "",
        f"with w = {info['mtp_weights']} for recursion depths 1..{len(info['mtp_weights'])}. Depth 1 is the",
        "ordinary MTP objective; depth k > 1 trains the recursive draft (the layer fed its own previous",
        "output hidden state, with the attention context it has at inference, teacher-forced token",
        "embeddings) so that drafts 2 and 3 are useful too. The target hidden state is detached in the",
        "MTP branch, so the MTP objective only shares gradients with the target through the tied",
        "embedding/`lm_head`.",
        "",
        f"Training loop: **{info['train_seconds'] / 60:.1f} min** wall"
        + (f" ({info['cpu_seconds'] / 60:.1f} CPU-min)" if "cpu_seconds" in info else "") + ";",
        f"whole script (corpus, tokenizer, training, saving, evaluation): {info['total_seconds'] / 60:.1f} min, on",
        f"{info['machine']}."
        + (f" Mean 1-min load average during training: {info['mean_load']:.1f} (about 2 is this job alone on"
           " 2 cores; more means the machine was shared). At the fastest rate seen during the run the loop"
           f" takes {info['uncontended_estimate_seconds'] / 60:.0f} min." if "mean_load" in info else "")
        + (f" {info['timing_note']}" if info.get("timing_note") else ""),
        "",
        "![loss curve](loss_curve.png)",
        "",
        "## Evaluation (held-out files, weights reloaded from this folder in fp32)",
        "",
        f"Per-token cross-entropy over {ppl['tokens']:,} held-out tokens "
        f"(non-overlapping {info['args']['seq_len']}-token",
        "windows, every position scored):",
        "",
        "| | CE (nats/token) | perplexity | top-1 |",
        "|---|---|---|---|",
        "| unigram baseline (train-split frequencies, add-one smoothing) | "
        f"{ppl['unigram_loss']:.3f} | {ppl['unigram_ppl']:.1f} | |",
        "| **pdserve-tiny** (next token x_{i+1}) | "
        f"**{ppl['loss']:.3f}** | **{ppl['ppl']:.2f}** | {ppl['top1']:.1%} |",
        "| MTP layer, teacher-forced (token after next, x_{i+2}) | "
        f"{ppl['mtp_loss']:.3f} | {ppl['mtp_ppl']:.2f} | {ppl['mtp_top1']:.1%} |",
        "",
        "### MTP acceptance",
        "",
        f"{acc['sequences']} prompts of {acc['prompt_len']} tokens are cut from the held-out stream; the target",
        f"generates {acc['generated']} tokens greedily (no EOS stop). At each generated position i (the target has",
        "just produced x_{i+1}; i runs from the last prompt position on) the MTP layer drafts d_1 for x_{i+2},",
        "then recursively d_2 for x_{i+3} and d_3 for x_{i+4} (exactly as the engine does, see below), and each",
        f"draft is compared with the token the target actually produced there ({acc['positions']:,} positions).",
        "Greedy verification accepts the longest correct prefix of the drafts.",
        "",
        "| draft position k | cumulative: P(d_1..d_k all accepted) "
        "| conditional: P(d_k accepted \\| d_1..d_{k-1} accepted) |",
        "|---|---|---|",
    ]
    for k in range(len(acc["cumulative"])):
        lines.append(f"| {k + 1} | {acc['cumulative'][k]:.1%} | {acc['conditional'][k]:.1%} |")
    lines += [
        "",
        "Mean acceptance length (tokens per target forward = 1 bonus/corrected token + accepted drafts,",
        "`1 + sum_k cumulative_k`, averaged over positions) for K speculative tokens:",
        "",
        "| K | 1 | 2 | 3 |",
        "|---|---|---|---|",
        "| mean acceptance length | " + " | ".join(f"{x:.2f}" for x in acc["mean_accept_len"]) + " |",
        "",
        "Greedy text from a tiny model is repetitive, which helps the drafts. Acceptance measures agreement",
        "with the target's own greedy choice, not with the truth. "
        + ("The distilled MTP layer (see MTP distillation) predicts the target's distribution rather than the"
           " data's, so its cross-entropy against the corpus (table above) is about the target's own."
           if "distillation" in info else
           "Note that the MTP layer predicts x_{i+2} *better* than the target does from the same tokens (the"
           " target predicts x_{i+2} at position i+1): it sees exactly x_0..x_{i+1}, but it is in effect a fifth"
           " layer whose attention reads the target's final states, on top of a 4-layer target."),
        "The build-time self-check below verifies that the MTP output at position i does not depend on any",
        "token after x_{i+1}.",
        "",
        "## MTP semantics (what pdserve implements at inference)",
        "",
        "Keys: `model.mtp_layers.0.{hidden_layernorm,token_layernorm,input_proj,final_layernorm}.weight` and one",
        "Qwen2 decoder block under the same prefix (`input_layernorm`, `self_attn.{q,k,v}_proj.{weight,bias}`,",
        "`self_attn.o_proj.weight`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`). transformers ignores",
        "them when loading the target.",
        "",
        "* Let h_i be the target's final hidden state at position i **after** the final `model.norm` (the",
        "  input of `lm_head`) and x_j the token ids; E is the shared embedding `model.embed_tokens`.",
        "* MTP input at position i: `input_proj(cat([hidden_layernorm(h_i), token_layernorm(E[x_{i+1}])], -1))`",
        "  (hidden first, token second; `input_proj` is Linear(2H -> H, no bias); both norms are RMSNorm).",
        "  The embedding term is **zeroed at position 0** (position id 0).",
        "* Then one Qwen2 decoder block (pre-norm, residual adds, causal self-attention over the MTP's own",
        "  KV of positions 0..i, RoPE at position id i with the target's rope_theta, SwiGLU MLP), then",
        "  `final_layernorm` (RMSNorm). Its output g_i is the MTP hidden state; the shared `lm_head(g_i)`",
        "  gives logits for **x_{i+2}**.",
        "* The MTP has its own KV cache (same block layout as the target layers). During prefill and after",
        "  every verification the MTP KV at position j is (re)computed from the true (h_j, x_{j+1}).",
        "* Draft k > 1: apply the layer again at position i+k-1, with `h := g` (the previous MTP output,",
        "  after `final_layernorm`) and the token embedding of its own previous draft d_{k-1}; its KV entry",
        "  is appended at position i+k-1 (so draft k attends to true-state KV at 0..i plus the entries of",
        "  drafts 2..k). Those speculative entries are overwritten once the target has verified the",
        "  tokens. `scripts/train_tiny_model.py::mtp_draft_incremental` is a step-by-step reference.",
        "",
        "Self-check at build time: MTP block vs transformers' `Qwen2DecoderLayer` with the same weights, max",
        f"|diff| {info['self_check']['block_vs_transformers_max_abs']:.1e}; step-by-step drafting vs the masked",
        f"teacher-forced passes, max logit |diff| {info['self_check']['incremental_vs_masked_max_logit_abs']:.1e}",
        f"over {info['self_check']['compared_drafts']} drafts; look-ahead check (change token x_m, m ="
        f" {info['self_check']['perturbed_token']}): first MTP position that changes is"
        f" {info['self_check']['first_changed_position']} (= m-1), max |diff| before it"
        f" {info['self_check']['lookahead_max_abs']:.1e}.",
        "",
        "## Samples (greedy, reloaded fp32 weights, 48 new tokens or up to an end token)",
        "",
    ] + [
        line for smp in info["samples"] for line in (
            f"Prompt `{smp['prompt']!r}`, prompt and completion:", "", "```",
            smp["prompt"] + smp["completion"], "```", "")
    ] + distillation_lines(info.get("distillation")) + [
        "",
        "## Reproduce",
        "",
        "From the repository root (after `make`, which creates `.venv`):",
        "",
        "```",
        info["command"],
        *([".venv/bin/python " + info["distillation"]["command"]] if "distillation" in info else []),
        "```",
        "",
        "`--report-only --out models/pdserve-tiny` re-runs the evaluation on the saved weights and rewrites",
        "this card and `training_summary.json` without training (the loss plot comes from `training_log.json`",
        "when present). `--no-autocast` trains in plain fp32 for CPUs without native bf16 (slower there; a",
        "different, equally good model).",
        "",
        f"Built with CPython {info['python_version']}, torch {info['torch_version']}, transformers",
        f"{info['transformers_version']}, tokenizers {info['tokenizers_version']}. The run is deterministic for a",
        "given seed on the same software and thread count; a different CPython version has a different",
        "standard library and therefore gives a different (similar) model.",
        "",
        "## License",
        "",
        "The training text is the CPython standard library and documentation (PSF License 2.0); the",
        "weights are derived from it.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=str(REPO_ROOT / "models" / "pdserve-tiny"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mtp-weight", type=float, default=0.5, help="loss weight of MTP depth 1")
    ap.add_argument("--mtp-train-depth", type=int, default=2, help="recursive MTP depths trained")
    ap.add_argument("--mtp-recursive-decay", type=float, default=0.5, help="weight factor per extra depth")
    ap.add_argument("--heldout-permille", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast for training matmuls (fp32 master weights); use --no-autocast "
                         "on CPUs without native bf16 (slower there, and a different result)")
    ap.add_argument("--eval-windows", type=int, default=256, help="held-out windows for perplexity")
    ap.add_argument("--quick-eval-windows", type=int, default=16, help="held-out windows for the curve")
    ap.add_argument("--accept-prompts", type=int, default=48)
    ap.add_argument("--accept-prompt-len", type=int, default=32)
    ap.add_argument("--accept-new-tokens", type=int, default=64)
    ap.add_argument("--report-only", action="store_true",
                    help="no training: re-evaluate the existing --out folder with the settings recorded in its "
                         "training_summary.json and rewrite its README.md, training_summary.json (and plot)")
    ap.add_argument("--timing-note", default="", help="with --report-only: a sentence about the run's timing")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    prior: dict = {}
    if args.report_only:
        # Re-evaluate an existing folder with the settings it was trained with.
        out_dir, note = args.out, args.timing_note
        prior = json.loads((Path(out_dir) / "training_summary.json").read_text())
        args = argparse.Namespace(**(vars(args) | prior["args"]))
        args.out, args.report_only, args.timing_note = out_dir, True, note
    t_start = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    torch.use_deterministic_algorithms(True)

    import tokenizers
    import transformers

    out = Path(args.out).resolve()
    # Build in a scratch folder outside the repository and replace `out` only
    # once everything has been written and checked (--report-only rewrites in place).
    tmp = out if args.report_only else Path(tempfile.mkdtemp(prefix=f"{out.name}-build-"))

    # 1. corpus
    docs = collect_corpus()
    train_docs = [d for d in docs if not is_heldout(d.relpath, args.heldout_permille)]
    held_docs = [d for d in docs if is_heldout(d.relpath, args.heldout_permille)]
    LOG.info("corpus: %d documents (%d held out), %.1f MB of text", len(docs), len(held_docs),
             sum(len(d.text) for d in docs) / 1e6)

    # 2. tokenizer
    if args.report_only:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        tok = train_tokenizer([d.text for d in train_docs], args.vocab_size)
    hf_tok = wrap_tokenizer(tok, 2048)
    eot_id, im_start_id, im_end_id = (tok.token_to_id(s) for s in SPECIAL_TOKENS)
    convs = chat_conversations(train_docs)
    chat_texts = [hf_tok.apply_chat_template(c, tokenize=False) for c in convs]
    train_stream = np.concatenate([
        encode_stream(tok, [d.text for d in train_docs], eot_id),
        encode_stream(tok, chat_texts, eot_id),
    ])
    heldout = encode_stream(tok, [d.text for d in held_docs], eot_id)
    LOG.info("tokenizer: vocab %d; train %d tokens (%d chats), held-out %d tokens",
             tok.get_vocab_size(), len(train_stream), len(chat_texts), len(heldout))

    # 3. model + training
    config, model, mtp = build_model(tok.get_vocab_size(), eot_id, im_end_id, args)
    n_target = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    n_mtp = sum(p.numel() for p in mtp.parameters())
    LOG.info("model: %d target + %d MTP parameters", n_target, n_mtp)
    if args.report_only:
        hist, train_seconds = load_history(out), prior["train_seconds"]
    else:
        hist, train_seconds = train(model, mtp, train_stream, heldout, args)
        LOG.info("training took %.1f s", train_seconds)
        # 4. save
        save_model(tmp, model, mtp, hf_tok, im_end_id, eot_id)

    # 5. reload exactly what was saved and evaluate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tl = logging.getLogger("transformers")
    prev_level = tl.level
    tl.setLevel(logging.ERROR)  # it reports the (intended) unused MTP keys
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    tl.setLevel(prev_level)
    mtp = load_mtp(tmp, model.config)
    tok_loaded = AutoTokenizer.from_pretrained(tmp)
    for text in [d.text[:3000] for d in held_docs[:8]] + chat_texts[:8]:
        if tok_loaded.encode(text) != tok.encode(text, add_special_tokens=False).ids:
            raise SystemExit("AutoTokenizer and the trained tokenizer disagree; fix the tokenizer pipeline")

    counts = np.bincount(train_stream, minlength=config.vocab_size).astype(np.float64)
    unigram_logp = torch.from_numpy(np.log((counts + 1.0) / (counts.sum() + config.vocab_size)))
    windows = heldout_windows(heldout, args.seq_len, args.eval_windows)
    ppl = eval_perplexity(model, mtp, windows, unigram_logp, args.batch_size)
    LOG.info("held-out: loss %.3f ppl %.2f | unigram loss %.3f ppl %.1f | MTP loss %.3f top1 %.3f",
             ppl["loss"], ppl["ppl"], ppl["unigram_loss"], ppl["unigram_ppl"], ppl["mtp_loss"], ppl["mtp_top1"])

    stride = max(1, (len(heldout) - args.accept_prompt_len) // args.accept_prompts)
    prompts = torch.from_numpy(np.stack([
        heldout[s * stride: s * stride + args.accept_prompt_len] for s in range(args.accept_prompts)
    ]).astype(np.int64))
    acc = eval_acceptance(model, mtp, prompts, args.accept_new_tokens, depth=3)
    check = self_check(model, mtp, acc.pop("_seqs"), acc.pop("_h"), depth=3)
    LOG.info("MTP acceptance cumulative %s conditional %s mean acceptance length K=1..3 %s",
             [round(x, 3) for x in acc["cumulative"]], [round(x, 3) for x in acc["conditional"]],
             [round(x, 2) for x in acc["mean_accept_len"]])
    LOG.info("self-check: %s", check)
    if (check["block_vs_transformers_max_abs"] > 1e-3 or check["incremental_vs_masked_max_logit_abs"] > 1e-2
            or check["lookahead_max_abs"] != 0.0 or check["first_changed_position"] != check["perturbed_token"] - 1):
        raise SystemExit(f"MTP self-check failed: {check}")

    samples = []
    chat_prompt = tok_loaded.apply_chat_template(
        [{"role": "user", "content": "What does the Python module `json` do?"}],
        tokenize=False, add_generation_prompt=True)
    for prompt in ["import os\n\n\ndef ", "class Stack:\n    ", chat_prompt]:
        ids = torch.tensor([tok_loaded.encode(prompt)])
        new = greedy_generate(model, ids, 48)[0, ids.shape[1]:].tolist()
        stops = [i for i, t in enumerate(new) if t in (eot_id, im_end_id)]
        new = new[: stops[0] + 1] if stops else new
        samples.append({"prompt": prompt, "completion": tok_loaded.decode(new)})
        LOG.info("sample: %r -> %r", prompt, samples[-1]["completion"])

    # 6. report
    if hist is not None:  # a folder from before training_log.json keeps its plot
        plot_losses(hist, tmp / "loss_curve.png", ppl["unigram_loss"], config.vocab_size)
    cmd_args = list(sys.argv[1:] if argv is None else argv)
    command = " ".join([".venv/bin/python", "scripts/train_tiny_model.py"] + cmd_args)
    if args.report_only:
        command = prior["command"]
    info = {
        "command": command,
        "args": {k: v for k, v in vars(args).items() if k not in ("report_only", "timing_note")}
        | {"out": os.path.relpath(out, REPO_ROOT) if out.is_relative_to(REPO_ROOT) else str(out)},
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})",
        "config": json.loads((tmp / "config.json").read_text()),
        "n_docs": len(docs), "n_heldout_docs": len(held_docs), "n_chats": len(chat_texts),
        "heldout_permille": args.heldout_permille,
        "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout)),
        "eot_id": eot_id, "im_start_id": im_start_id, "im_end_id": im_end_id,
        "params_target": n_target, "params_mtp": n_mtp, "params_total": n_target + n_mtp,
        "mtp_weights": [args.mtp_weight * args.mtp_recursive_decay ** k for k in range(args.mtp_train_depth)],
        "train_seconds": train_seconds,
        "ppl": ppl, "acceptance": acc, "self_check": check,
        "samples": samples,
    }
    if hist is not None and hist.chunk_wall:
        info |= {
            "final_train_loss": float(np.mean(hist.loss[-20:])),
            "cpu_seconds": float(sum(hist.chunk_cpu)),
            "mean_load": float(np.mean(hist.chunk_load)),
            "uncontended_estimate_seconds": float(min(hist.chunk_wall) * args.steps / max(1, args.steps // 10)),
        }
    info["total_seconds"] = time.time() - t_start
    if args.report_only:  # keep what only the training run could measure
        for key in ("total_seconds", "final_train_loss", "cpu_seconds", "mean_load",
                    "uncontended_estimate_seconds", "machine", "timing_note", "distillation"):
            if key in prior:
                info[key] = prior[key]
        if args.timing_note:
            info["timing_note"] = args.timing_note
    write_card(tmp, info)
    if args.report_only:
        hist = None  # training_log.json, if any, is already there
    if hist is not None:
        (tmp / "training_log.json").write_text(json.dumps({
            "step": hist.step,
            "target_loss": [round(x, 4) for x in hist.loss],
            "mtp_loss": [[round(x, 4) for x in row] for row in hist.mtp],
            "eval_step": hist.eval_step,
            "eval_target_loss": [round(x, 4) for x in hist.eval_loss],
            "eval_mtp_loss": [round(x, 4) for x in hist.eval_mtp],
            "chunk_wall_seconds": [round(x, 2) for x in hist.chunk_wall],
            "chunk_cpu_seconds": [round(x, 2) for x in hist.chunk_cpu],
            "chunk_load_avg": [round(x, 2) for x in hist.chunk_load],
        }) + "\n")
    (tmp / "training_summary.json").write_text(json.dumps(
        {k: v for k, v in info.items() if k != "config"}, indent=2, sort_keys=True) + "\n")

    if not args.report_only:
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp), str(out))
        os.chmod(out, 0o755)  # mkdtemp made it private
    size = sum(f.stat().st_size for f in out.iterdir())
    LOG.info("wrote %s (%.2f MB) in %.1f min", out, size / 1e6, (time.time() - t_start) / 60)
    print(json.dumps({
        "command": command, "train_minutes": round(train_seconds / 60, 2),
        "params_total": n_target + n_mtp, "heldout_ppl": round(ppl["ppl"], 3),
        "unigram_ppl": round(ppl["unigram_ppl"], 2), "mtp_cumulative": acc["cumulative"],
        "mtp_conditional": acc["conditional"], "mean_accept_len": acc["mean_accept_len"],
        "folder_mb": round(size / 1e6, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
