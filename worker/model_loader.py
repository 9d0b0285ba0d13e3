"""Load a local Hugging Face checkpoint directory (single or sharded safetensors) into our modules."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from worker import cpu_attention
from worker.models.linear import Linear, bf16_linear_available, checkpoint_tensors, native_bf16_cpu, pack_linears
from worker.models.llama import CausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {str(model_dir)!r}")
    return files


def load_state_into(module: torch.nn.Module, model_dir: Path, prefix_map: dict[str, str] | None = None,
                    skip: frozenset[str] = frozenset(), round_to: torch.dtype | None = None) -> set[str]:
    """Copy checkpoint tensors into `module`'s parameters and persistent buffers (stacked
    projections take their pieces by Hugging Face name: see `checkpoint_tensors`), each first
    rounded to `round_to` if given.

    Returns the checkpoint keys that were used. A parameter with no checkpoint key is an error
    naming it; unused checkpoint keys are left to the caller to report.
    """
    wanted = {name: t for name, t in checkpoint_tensors(module).items() if name not in skip}
    used: set[str] = set()
    found: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = key
                if prefix_map:
                    for src, dst in prefix_map.items():
                        if key.startswith(src):
                            name = dst + key[len(src):]
                if name not in wanted:
                    continue
                tensor = f.get_tensor(key)
                param = wanted[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"model: checkpoint key {key!r} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(param.shape)}")
                if round_to is not None:
                    tensor = tensor.to(round_to)
                with torch.no_grad():
                    param.copy_(tensor.to(param.dtype))
                used.add(key)
                found.add(name)
    missing = sorted(set(wanted) - found)
    if missing:
        raise ValueError(f"model: checkpoint in {str(model_dir)!r} is missing key {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return used


def all_checkpoint_keys(model_dir: Path) -> set[str]:
    keys: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    return keys


def activation_dtype(dtype: str, device: str) -> str:
    """The dtype activations and the KV cache are computed in for weights of `dtype`: float32 for
    bfloat16 on a CPU (bf16 storage, fp32 arithmetic: most CPUs have no bf16 math, and where they
    do oneDNN's bf16 GEMM loses to the bf16-weight kernel at decode sizes,
    benchmarks/results/bf16_linear.txt), else `dtype` itself."""
    return "float32" if dtype == "bfloat16" and device == "cpu" else dtype


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: str, device: str, max_positions: int,
               num_mtp_layers: int = 0, draft_dtype: str | None = None, compiled: bool = False,
               draft_vocab: list[int] | None = None, quantization: str | None = None) -> CausalLM:
    """The model of `model_dir` with its weights in `dtype` (see activation_dtype) and, with
    `quantization="int8"`, its decoder layers' linears in int8 (narrow_linears). `draft_dtype` is
    the MTP drafter's (resolve_draft_dtype, for the activation dtype)."""
    model_dir = Path(model_dir)
    if num_mtp_layers > cfg.num_mtp_layers:
        raise ValueError(f"speculative_method: 'mtp' needs MTP layers, but {str(model_dir)!r} has "
                         f"num_nextn_predict_layers={cfg.num_mtp_layers}; use 'ngram' or none")
    compute = activation_dtype(dtype, device)
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions, num_mtp_layers)
    model = model.to_empty(device=device).to(DTYPES[compute])
    # to_empty leaves the non-persistent RoPE tables uninitialised: rebuild them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg, max_positions).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # A tied lm_head shares the embedding; checkpoints usually omit (or duplicate) its key.
    skip = frozenset({"lm_head.weight"}) if cfg.tie_word_embeddings else frozenset()
    # Weights stored narrower than the arithmetic: every tensor takes the value it would have in
    # `dtype` (a bf16 checkpoint loses nothing), so norms and biases round as the big weights do.
    used = load_state_into(model, model_dir, skip=skip, round_to=DTYPES[dtype] if dtype != compute else None)
    unused = sorted(all_checkpoint_keys(model_dir) - used - {"lm_head.weight"})
    if unused:
        logger.info("ignoring %d checkpoint keys the model does not use (e.g. %s)", len(unused), unused[0])
    bf16_weights = bool(num_mtp_layers) and draft_weights_only(draft_dtype, compute, device)
    if num_mtp_layers and draft_dtype and draft_dtype != compute and not bf16_weights:
        model.set_draft_dtype(DTYPES[draft_dtype])
    if num_mtp_layers and draft_vocab is not None:
        model.set_draft_vocab(draft_vocab)
    narrow_bf16, narrow_int8 = narrow_linears(model, dtype, compute, quantization)
    # (rounded before packing, which may free the fp32 weights)
    halves = [(lin, lin.weight.detach().to(torch.bfloat16)) for lin in model.draft_linears()] if bf16_weights else []
    head = model.lm_head.weight.detach().to(torch.bfloat16) \
        if bf16_weights and model.draft_head is None and model.lm_head not in narrow_bf16 else None
    # Unpacked: compiled layers (torch.compile cannot trace a packed weight), the MTP layers of a
    # bf16-weight drafter, whose fused op multiplies bigger inputs by the plain fp32 weight, and
    # the linears stored narrow below.
    skip = ([model.model.layers] if compiled else []) + ([model.model.mtp_layers] if bf16_weights else [])
    # Plain weights read after packing: a tied embedding's, and lm_head's where a drafter's head
    # takes it over (set_bf16_draft_head, gemm_weight).
    shared = {id(model.model.embed_tokens.weight)} | ({id(model.lm_head.weight)} if num_mtp_layers else set())
    pack_linears(model, device, shared=shared, skip=skip + narrow_bf16 + narrow_int8)
    for lin in narrow_bf16:
        lin.store_bf16()
    for lin in narrow_int8:
        lin.quantize_int8()
    if narrow_bf16 or narrow_int8:
        logger.info("weights: %d linears stored in bfloat16, %d in int8 (per-channel), arithmetic in %s",
                    len(narrow_bf16), len(narrow_int8), compute)
    if bf16_weights and model.draft_head is None and head is None:
        head = model.lm_head.weight.detach()  # lm_head is bf16 already: the draft head shares it
    finish_drafter(model, halves, head, bf16_weights)
    return model.eval()


def narrow_linears(model: CausalLM, dtype: str, compute: str,
                   quantization: str | None) -> tuple[list[Linear], list[Linear]]:
    """(the linears to store in bf16, those to quantize to int8). int8: every linear of the decoder
    layers (q/k/v/o, gate/up/down), as vLLM's w8a16 does; lm_head, the embedding and the MTP
    drafter keep their dtype (the drafter's precision is --draft-dtype's). bf16 storage under fp32
    arithmetic: the remaining decoder linears and lm_head. The embedding stays fp32 (with bf16
    values): a step reads a few of its rows, and the fused MTP ops read it as fp32; a tied lm_head
    then gets its own bf16 copy."""
    layers = [m for m in model.model.layers.modules() if isinstance(m, Linear)]
    int8 = layers if quantization == "int8" else []
    if dtype == compute:
        return [], int8
    return [lin for lin in [*layers, model.lm_head] if all(lin is not q for q in int8)], int8


def finish_drafter(model: CausalLM, halves: list, head: torch.Tensor | None, bf16_weights: bool) -> None:
    """The bf16-weight MTP drafter's copies (Linear.keep_bf16, the draft head) and its fused layer."""
    for lin, half in halves:
        lin.keep_bf16(half)
    if head is not None:
        model.set_bf16_draft_head(head)
    if bf16_weights and cpu_attention.available():
        for layer in model.model.mtp_layers:
            layer.fuse()


def draft_weights_only(draft_dtype: str | None, dtype: str, device: str) -> bool:
    """Whether a bfloat16 drafter keeps fp32 arithmetic and only its weights in bf16 (for a float32
    target on a CPU): the weight bytes a few-row draft step reads from memory are what its time goes
    to, and bf16 arithmetic gains nothing there -- emulated where the CPU has no bf16 math (slower
    than fp32), and where it has, oneDNN's bf16 GEMM pays a fixed cost a call that makes it slower
    than the bf16-weight kernel at a few rows (benchmarks/results/bf16_linear.txt)."""
    return draft_dtype == "bfloat16" and dtype == "float32" and device == "cpu" and bf16_linear_available()


DRAFT_VOCAB_FILE = "draft_vocab.json"  # written by scripts/make_draft_vocab.py


def resolve_draft_vocab(draft_vocab: str, model_dir: str | Path) -> list[int] | None:
    """The token ids MTP drafts over (None: the whole vocabulary). "auto": the checkpoint's
    draft_vocab.json where it has one, "full": the whole vocabulary, else a path to such a file
    (a JSON object whose "token_ids" lists the ids)."""
    if draft_vocab == "full":
        return None
    path = Path(model_dir) / DRAFT_VOCAB_FILE if draft_vocab == "auto" else Path(draft_vocab)
    if draft_vocab == "auto" and not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["token_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"draft_vocab: cannot read token_ids from {str(path)!r} ({e})") from e
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"draft_vocab: {str(path)!r} must list token ids as integers")
    return ids


def resolve_draft_dtype(draft_dtype: str, dtype: str, device: str) -> str:
    """"auto": bfloat16 drafting for a float32 target on a CPU: bf16 weights with fp32 arithmetic
    (draft_weights_only), or bf16 math where that kernel cannot be built and the CPU has it natively;
    the target's dtype elsewhere."""
    if draft_dtype != "auto":
        return draft_dtype
    cpu_fp32 = dtype == "float32" and device == "cpu"
    return "bfloat16" if cpu_fp32 and (native_bf16_cpu() or bf16_linear_available()) else dtype
