"""Engine configuration: one dataclass shared by every role (colocated, prefill, decode)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine import settings
from engine.types import EngineRole, KVTransferMode

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


def flag(help_: str, **extra: Any) -> dict[str, Any]:
    """Field metadata that makes a field a command-line flag (server/flags.py builds the flags).
    `extra`: `default=` where the command line's default differs from the field's, `flag=` where
    the flag is not named after the field, `role=` the engine role it applies to (said in its help)."""
    return {"help": help_, **extra}


@dataclass
class KVTransferConfig:
    """KV-port settings of a prefill or decode engine (the `--kv-*` flags)."""

    addr: str = field(default="", metadata=flag("bind address of the KV port (default tcp://127.0.0.1:random)",
                                                role="prefill"))
    advertise: str = field(default="", metadata=flag(
        "KV address decode instances dial, e.g. tcp://{ip}:5700 ({ip}: this host's routable address; default: "
        "derived from --kv-addr, never loopback for a 0.0.0.0 bind)", role="prefill"))
    key: str = field(default="", metadata=flag("shared key required on the KV port"))
    lease_s: float = field(default=30.0, metadata=flag(
        "free held KV blocks after this long without the decode side", role="prefill"))
    # Progress comes at least every few seconds on a working link whatever the model and the link
    # speed: frames are small (sender.MAX_FRAME_BYTES) and P answers every KeepAlive
    # (kv_transfer/receiver.py). So this bound is about outages: it rides out a partition shorter than
    # it (the pulls resume where they were) and gives a transfer whose prefill went silent to a retry elsewhere.
    deadline_s: float = field(default=30.0, metadata=flag(
        "give up a KV transfer that made no progress for this long (one still receiving never)", role="decode"))
    reserve_deadline_s: float = field(default=20.0, metadata=flag(
        "fail a request (retryable) that got no KV blocks within this long", role="decode"))
    # Off by default: benchmarks/results/bench_pd.txt measures what it costs against raw ZMQ.
    checksum: bool = field(default=False, metadata=flag(
        "checksum every KV payload (xxh3); decode verifies any it gets", role="prefill"))
    # benchmarks/results/bench_pd.txt measures the hand-off latency of both: layer-wise cuts it on long prompts.
    mode: KVTransferMode = field(default=KVTransferMode.LAYERWISE, metadata=flag(
        "layerwise | after-prefill: push each layer's KV as the prefill writes it, or all of it after "
        "(benchmarks/results/bench_pd.txt)", flag="--kv-transfer-mode", role="prefill"))
    # Each layer snapshot costs P's step a fixed amount, more than a short prompt's whole-transfer
    # hand-off saves (benchmarks/results/bench_pd.txt, section (c) and the short-prompt A/B).
    layerwise_min_tokens: int = field(default=512, metadata=flag(
        "layer-wise mode: prompts shorter than this go in one message after their prefill (0: none)",
        role="prefill"))


@dataclass
class EngineConfig:
    """Engine arguments; names follow vLLM's where they exist. A field with `flag` metadata is a
    command-line flag of every engine command (server/flags.py)."""

    model: str = field(default_factory=default_model, metadata=flag(
        "local Hugging Face checkpoint directory (default: the bundled pdserve-tiny)", default=None))
    max_num_seqs: int = field(default=64, metadata=flag("request slots per engine"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag("token budget per step"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "context length (default: the model's, at most 4096)"))
    block_size: int = field(default=16, metadata=flag("tokens per KV block"))
    num_kv_blocks: int | None = field(default=None, metadata=flag(
        "KV blocks (default: derived from --kv-memory-fraction)"))
    kv_memory_fraction: float = field(default=0.05, metadata=flag(
        "fraction of RAM (CPU) or free GPU memory for the KV cache (when --num-kv-blocks is unset)"))
    enable_prefix_caching: bool = field(default=True, metadata=flag("reuse the KV blocks of shared prompt prefixes"))
    # Weight storage. bfloat16 on a CPU: bf16 weights, fp32 arithmetic and KV cache (worker/model_loader.py).
    dtype: str = field(default="float32", metadata=flag(
        "float32 | bfloat16 | float16 (bfloat16 on a CPU: bf16 weights, fp32 arithmetic)"))
    # "int8": the decoder layers' linears as weight-only int8, one scale per output feature, made at
    # load time from the checkpoint; activations stay in the activation dtype (worker/models/linear.py).
    quantization: str | None = field(default=None, metadata=flag(
        "int8 (the decoder layers' linears as weight-only int8, per output channel, made at load time) | none",
        default="none"))
    device: str = field(default="cpu", metadata=flag("cpu | cuda"))
    seed: int = field(default=0, metadata=flag("default sampling seed"))
    num_threads: int | None = field(default=None, metadata=flag("torch threads per engine process"))
    # "auto" (the command line's default) becomes "mtp" where the model has MTP layers, else None (validate).
    speculative_method: str | None = field(default=None, metadata=flag(
        "mtp | ngram | none | auto (mtp when the model has MTP layers)", default="auto"))
    # With the bundled model's distilled MTP layer a third draft does not pay at batch 1
    # (benchmarks/results/bench_spec.txt), and allowing it lets the server's noisy step timings lead
    # the adaptive policy to pick it where two drafts are faster.
    num_speculative_tokens: int = field(default=2, metadata=flag(
        "draft tokens per step (the most, under --spec-policy adaptive)"))
    # Precision of the MTP drafter (its layer and the draft lm_head). Drafts are only proposals that
    # the target verifies, so this trades nothing but draft quality for speed. "auto": bfloat16
    # weights with fp32 arithmetic for a float32 target on a CPU (worker/model_loader.py), else the target's dtype.
    draft_dtype: str = field(default="auto", metadata=flag(
        "MTP drafter precision: auto | float32 | bfloat16 | float16"))
    # The MTP layer attends only the last this many positions (0: all of them). Positions older than
    # that need no MTP pass at all (worker/spec_decode/mtp.py): on a prefill engine the pass over a prompt
    # covered every position, a sizeable share of the prefill work on the bundled model, whose
    # acceptance is the same with 32 positions as with all, and lower with 16
    # (benchmarks/results/bench_spec.txt). 32 rather than 64 halves what MTP adds to a prefill
    # engine's work, which under load competes with decode for the same cores. Output is exact either way.
    mtp_window: int = field(default=32, metadata=flag(
        "positions the MTP layer attends (0: all); older ones need no MTP pass"))
    # The tokens MTP drafts over (FR-Spec): "auto" the checkpoint's draft_vocab.json where it has one
    # (the bundled model's is the training corpus' most frequent tokens, scripts/make_draft_vocab.py),
    # "full" the whole vocabulary, or a path to such a file. Output is exact either way.
    draft_vocab: str = field(default="auto", metadata=flag(
        "tokens MTP drafts over: auto (the checkpoint's draft_vocab.json if any) | full | a path to such a file"))
    # Run the model eagerly instead of compiling its forward with torch.compile (worker/compilation.py).
    # None: PDSERVE_ENFORCE_EAGER if set, else eager on CPU, where compiling won or lost by batch size
    # and gained little on long prefills, nothing through the server, for a much longer start-up per
    # engine (benchmarks/results/compile.txt); compiled on CUDA.
    enforce_eager: bool | None = field(default=None, metadata=flag(
        "run the model eagerly instead of compiling it with torch.compile (default: eager on CPU, compiled on CUDA)"))
    # How many drafts per step: "adaptive" (0..K from measured acceptance and step cost,
    # worker/spec_decode/policy.py) or "fixed" (always K). Applies to MTP; n-gram is always fixed.
    spec_policy: str = field(default="adaptive", metadata=flag(
        "adaptive (0..K drafts per step from measured acceptance and cost) | fixed"))
    # Mixed into the default sampling seed so that engines sharing --seed do not share noise
    # (set by the engine process from its name, which is unique within a deployment).
    instance_name: str = ""
    # Whether the runner drafts at all; decided by `for_role` (False on a prefill engine).
    proposes_drafts: bool = True

    def for_role(self, role: EngineRole | str) -> EngineConfig:
        """This configuration as an engine of `role` runs it: the one place where the role changes
        engine settings. A prefill engine's requests leave after their first token, so it never
        drafts; with MTP it still runs one MTP layer, whose KV of the prompt the hand-off carries
        (same KV layout as the decode side), and n-gram drafting, which has no KV, is dropped."""
        if role != EngineRole.PREFILL:
            return replace(self, proposes_drafts=True)
        keeps_mtp = self.speculative_method in ("mtp", "auto")
        return replace(self, proposes_drafts=False, speculative_method=self.speculative_method if keeps_mtp else None,
                       num_speculative_tokens=1 if keeps_mtp else self.num_speculative_tokens)

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
        if self.speculative_method == "auto":
            self.speculative_method = "mtp" if model_cfg.num_mtp_layers > 0 else None
        if self.speculative_method in ("none", ""):
            self.speculative_method = None
        if self.speculative_method not in (None, "mtp", "ngram"):
            raise ValueError(f"speculative_method must be 'mtp', 'ngram', 'auto' or 'none', "
                             f"got {self.speculative_method!r}")
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
