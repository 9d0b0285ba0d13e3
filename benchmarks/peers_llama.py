"""llama.cpp's `llama-server` as a peer of benchmarks/bench_peers.py: paths, GGUF conversion, command lines.

`scripts/install_llama_cpp.sh` builds the server from the sources vendored in llama-cpp-python's
sdist and makes a venv for llama.cpp's own converter (`convert_hf_to_gguf.py` with its `gguf-py`).
Checkpoints are converted once per (checkpoint, output type) into a cache beside the build, keyed
by the checkpoint's files, so a rerun does not convert again and a changed checkpoint is converted
anew. Nothing here imports llama.cpp code: the converter runs in its venv as a subprocess.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from pathlib import Path

from server.procs import stop_process_group

logger = logging.getLogger("bench_peers.llama")
REPO = Path(__file__).resolve().parents[1]
VERSION = "0.3.36"  # llama-cpp-python's sdist, as scripts/install_llama_cpp.sh builds it
DEFAULT_PREFIX = Path(os.environ.get("PDSERVE_LLAMA_CPP", Path.home() / ".cache" / "pdserve" / f"llama.cpp-{VERSION}"))
# The GGUF output types the benchmark uses: F32 beside pdserve's fp32, Q8_0 beside its int8.
OUTTYPES = ("f32", "q8_0")


def server_binary(prefix: Path) -> Path:
    return prefix / "bin" / "llama-server"


def converter_python(prefix: Path) -> Path:
    return prefix / "gguf-venv" / "bin" / "python"


def cpu_flags() -> str:
    """This CPU's feature flags, sorted, as scripts/install_llama_cpp.sh stamps its build with them."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return " ".join(sorted(line.split(":", 1)[1].split()))
    return ""


def installed(prefix: Path) -> bool:
    """A build for this CPU (GGML_NATIVE: another CPU's build may use instructions this one lacks)."""
    stamp = prefix / "bin" / "CPU_FLAGS"
    return (
        server_binary(prefix).is_file()
        and converter_python(prefix).is_file()
        and stamp.is_file()
        and stamp.read_text().strip() == cpu_flags()
    )


def version(prefix: Path) -> str:
    """The llama.cpp commit the install script recorded (the sdist has no .git, so the binary's own
    build info has no commit), with the binary's version line."""
    try:
        commit = (prefix / "LLAMA_CPP_COMMIT").read_text().strip() or "unknown"
    except OSError:
        commit = "unknown"
    try:
        run = subprocess.run([str(server_binary(prefix)), "--version"], capture_output=True, text=True, timeout=30)
        line = next((x for x in (run.stdout + run.stderr).splitlines() if x.startswith("version:")), "")
    except (OSError, subprocess.SubprocessError):
        line = ""
    return f"commit {commit} ({line or 'version unknown'}; vendored by llama-cpp-python {VERSION})"


def convert_argv(prefix: Path, model: Path, outtype: str, outfile: Path, pre_tokenizer: str | None) -> list[str]:
    """The converter's command line: llama.cpp's `convert_hf_to_gguf.py MODEL --outtype T --outfile F`,
    run by benchmarks/peers_gguf.py in the converter's venv. That wrapper only adds a fallback for the
    pre-tokenizer name (`--pre-tokenizer`), which the converter recognises by a hash of known vocabularies
    and so never for the bundled tokenizer's own vocabulary; see peers_gguf.py."""
    argv = [str(converter_python(prefix)), str(REPO / "benchmarks" / "peers_gguf.py")]
    if pre_tokenizer:
        argv += ["--pre-tokenizer", pre_tokenizer]
    return argv + [
        str(prefix / "src" / "convert_hf_to_gguf.py"),
        str(model),
        "--outtype",
        outtype,
        "--outfile",
        str(outfile),
    ]


def server_argv(
    prefix: Path, gguf: Path, parallel: int, threads: int, ctx_per_slot: int, batch: int, alias: str
) -> list[str]:
    """`llama-server` with `parallel` slots of `ctx_per_slot` tokens each (an explicit --parallel gives each
    slot -c / parallel of the context), continuous batching, `threads` threads for decode and prompt
    alike, a logical batch of `batch` tokens (pdserve's token budget per step), on 127.0.0.1 only; the
    caller appends `--port`."""
    return [
        str(server_binary(prefix)),
        "-m", str(gguf),
        "--host", "127.0.0.1",
        "--parallel", str(parallel),
        "-cb",
        "-t", str(threads),
        "-tb", str(threads),
        "-c", str(parallel * ctx_per_slot),
        "-b", str(batch),
        "--alias", alias,
        "--no-webui",
        # pdserve bench scrapes /metrics before and after a run; without the endpoint llama-server drops
        # that connection, and a request sent on the same pooled connection then fails.
        "--metrics",
    ]  # fmt: skip


def checkpoint_key(model: Path) -> str:
    """A short hash of the checkpoint's files, names and contents: a fresh copy of the same checkpoint
    (the MTP-free copy bench_peers writes each run) finds its conversion, a changed one does not."""
    h = hashlib.sha256()
    for f in sorted(model.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0")
            with f.open("rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()[:12]


def ensure_gguf(prefix: Path, model: Path, outtype: str, pre_tokenizer: str | None, timeout: float) -> Path:
    """The GGUF of `model` in `outtype`, converted now unless the cache has it; raises on failure."""
    cache = prefix / "gguf" / f"{model.name}-{checkpoint_key(model)}"
    out = cache / f"{model.name}-{outtype}.gguf"
    if out.is_file():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    argv = convert_argv(prefix, model, outtype, partial, pre_tokenizer)
    log = cache / f"convert-{outtype}.log"
    logger.info("converting %s to %s: %s", model, outtype, " ".join(argv))
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"GGUF conversion still running after {timeout:.0f} s (log {log})") from None
    finally:
        stop_process_group(proc)
    if rc != 0 or not partial.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
        raise RuntimeError(f"GGUF conversion of {model} to {outtype} exited with {rc}:\n{tail}")
    partial.rename(out)  # only a finished conversion gets the final name
    return out
