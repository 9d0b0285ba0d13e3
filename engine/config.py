"""Engine configuration: one dataclass shared by every role (colocated, prefill, decode)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import settings

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "pdserve-tiny"


def default_model() -> str:
    """The bundled tiny model, found relative to the package so any working directory works."""
    return settings.MODEL.get() or str(DEFAULT_MODEL_DIR)


@dataclass
class ModelConfig:
    """The parts of a Hugging Face `config.json` the engine needs, normalised across families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: list[int]
    num_mtp_layers: int
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model: {model_dir!r} has no config.json (expected a Hugging Face checkpoint directory)")
        cfg = json.loads(path.read_text())
        model_type = cfg.get("model_type", "")
        if model_type not in cls.SUPPORTED:
            raise ValueError(f"model: architecture {model_type!r} is not supported "
                             f"(supported: {', '.join(cls.SUPPORTED)})")
        # transformers >= 5 nests rope settings under `rope_parameters`; older versions use
        # top-level `rope_theta` and `rope_scaling`. Accept both.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        gen_cfg = Path(model_dir) / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id", eos)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        sliding = cfg.get("sliding_window") if model_type == "mistral" else None
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
            raw=cfg,
        )


def default_max_model_len(model_cfg: ModelConfig) -> int:
    """The context length when none is given: the model's, at most 4096 (the KV cache is small)."""
    return min(model_cfg.max_position_embeddings, 4096)


@dataclass
class KVTransferConfig:
    """KV-port settings of a prefill or decode engine (the `--kv-*` flags)."""

    addr: str = ""          # prefill: bind address of the KV port (default tcp://127.0.0.1:random)
    advertise: str = ""     # prefill: the address decode instances dial (default: derived from addr)
    key: str = ""           # shared key required on the KV port
    lease_s: float = 30.0   # prefill: free held blocks after this long without the decode side
    # decode: give up a KV transfer after this long without progress (no KV arriving from its prefill
    # and no word from it that the KV is still being computed; kv_transfer/receiver.py). Progress comes
    # at least every few seconds on a working link whatever the model and the link speed: frames are
    # small (sender.MAX_FRAME_BYTES) and P answers every KeepAlive. So this bound is about outages:
    # it rides out a partition shorter than it (the pulls resume where they were) and gives a
    # transfer whose prefill went silent to a retry elsewhere after it.
    deadline_s: float = 30.0
    reserve_deadline_s: float = 20.0  # decode: fail a request that got no KV blocks within this long (retryable)
    # prefill: send an xxh3 checksum of each payload (decode verifies any it gets). Off by default:
    # benchmarks/results/bench_pd.txt measures what it costs against raw ZMQ.
    checksum: bool = False
    # prefill: when the KV goes out (engine.types.KVTransferMode); benchmarks/results/bench_pd.txt
    # measures the hand-off latency of both: layer-wise cuts it on long prompts.
    mode: str = "layerwise"
    # prefill, layer-wise: prompts shorter than this go in one message after the prefill all the same.
    # Each layer snapshot costs P's step a fixed amount, more than a short prompt's whole-transfer
    # hand-off saves (benchmarks/results/bench_pd.txt, section (c) and the short-prompt A/B). 0: every prompt.
    layerwise_min_tokens: int = 512


@dataclass
class EngineConfig:
    """Engine arguments; names follow vLLM's where they exist."""

    model: str = field(default_factory=default_model)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.05  # of host RAM (CPU) or free device memory (CUDA), when num_kv_blocks is unset
    enable_prefix_caching: bool = True
    # Weight storage. bfloat16 on a CPU: bf16 weights, fp32 arithmetic and KV cache (worker/model_loader.py).
    dtype: str = "float32"
    # "int8": the decoder layers' linears as weight-only int8, one scale per output feature, made at
    # load time from the checkpoint; activations stay in the activation dtype (worker/models/linear.py).
    quantization: str | None = None
    device: str = "cpu"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads for this process
    speculative_method: str | None = None  # "mtp", "ngram" or None
    num_speculative_tokens: int = 2
    # Precision of the MTP drafter (its layer and the draft lm_head). Drafts are only proposals that
    # the target verifies, so this trades nothing but draft quality for speed. "auto": bfloat16
    # weights with fp32 arithmetic for a float32 target on a CPU (worker/model_loader.py), else the target's dtype.
    draft_dtype: str = "auto"
    # The MTP layer attends only the last this many positions (0: all of them). Positions older than
    # that need no MTP pass at all (worker/drafter.py): on a prefill engine the pass over a prompt
    # covered every position, a sizeable share of the prefill work on the bundled model, whose
    # acceptance is the same with 32 positions as with all, and lower with 16
    # (benchmarks/results/bench_spec.txt). 32 rather than 64 halves what MTP adds to a prefill
    # engine's work, which under load competes with decode for the same cores. Output is exact either way.
    mtp_window: int = 32
    # The tokens MTP drafts over (FR-Spec): "auto" the checkpoint's draft_vocab.json where it has one
    # (the bundled model's is the training corpus' most frequent tokens, scripts/make_draft_vocab.py),
    # "full" the whole vocabulary, or a path to such a file. Output is exact either way.
    draft_vocab: str = "auto"
    # Run the model eagerly instead of compiling its forward with torch.compile (worker/compilation.py).
    # None: PDSERVE_ENFORCE_EAGER if set, else eager on CPU, where compiling won or lost by batch size
    # and gained little on long prefills, nothing through the server, for a much longer start-up per
    # engine (benchmarks/results/compile.txt); compiled on CUDA.
    enforce_eager: bool | None = None
    # How many drafts per step: "adaptive" (0..K from measured acceptance and step cost,
    # worker/spec_policy.py) or "fixed" (always K). Applies to MTP; n-gram is always fixed.
    spec_policy: str = "adaptive"
    # Mixed into the default sampling seed so that engines sharing --seed do not share noise
    # (set by the engine process from its name, which is unique within a deployment).
    instance_name: str = ""

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots beyond the scheduled tokens that drafting writes into (recursive MTP drafts)."""
        return self.num_speculative_tokens if self.speculative_method else 0

    def validate(self, model_cfg: ModelConfig) -> None:
        if self.enforce_eager is None:
            eager = settings.ENFORCE_EAGER.get()
            self.enforce_eager = eager if eager is not None else not self.device.startswith("cuda")
        if self.max_model_len is None:
            self.max_model_len = default_max_model_len(model_cfg)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be int8 or none, got {self.quantization!r}")
        if not self.device.startswith("cuda") and not self.enforce_eager and \
                (self.quantization or self.dtype == "bfloat16"):
            raise ValueError("--quantization int8 and --dtype bfloat16 run eagerly on a CPU (their weight kernels "
                             "are not traced by torch.compile): drop --no-enforce-eager")
        if self.speculative_method in ("none", ""):
            self.speculative_method = None
        if self.speculative_method not in (None, "mtp", "ngram"):
            raise ValueError(f"speculative_method must be 'mtp', 'ngram' or 'none', got {self.speculative_method!r}")
        if self.draft_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"draft_dtype must be auto, float32, bfloat16 or float16, got {self.draft_dtype!r}")
        if self.speculative_method and not 1 <= self.num_speculative_tokens <= 8:
            raise ValueError(f"num_speculative_tokens must be in [1, 8], got {self.num_speculative_tokens}")
        if self.mtp_window < 0:
            raise ValueError(f"mtp_window must be >= 0 (0: attend every position), got {self.mtp_window}")
        if self.spec_policy not in ("adaptive", "fixed"):
            raise ValueError(f"spec_policy must be adaptive or fixed, got {self.spec_policy!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
