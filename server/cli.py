"""The `pdserve` command line.

    pdserve serve      front end + N prefill + M decode engines (or one colocated engine) on this host
    pdserve prefill    one prefill engine process        pdserve decode   one decode engine process
    pdserve colocated  one colocated engine process      pdserve server   the front end alone
                       (engines connect to the front end's --bind-addr and are found by their heartbeats)
    pdserve generate   offline generation (no server)
    pdserve bench      load-test an OpenAI-compatible endpoint (vLLM `bench serve` definitions)
    pdserve keygen     write a cluster key (CURVE) file: give it to every process as PDSERVE_CLUSTER_KEY_FILE

Every flag can also be set by environment variable: --max-num-seqs is PDSERVE_MAX_NUM_SEQS.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from engine import settings
from engine.cluster_key import CLUSTER_KEY_FILE_ENV, ClusterKey
from engine.config import (
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    default_max_model_len,
    default_model,
)
from engine.types import EngineRole, ServeMode
from server.allocator import engine_env, reexec_with_tcmalloc
from server.flags import add_flag, add_flags, from_args, to_argv
from server.front_end_config import FrontEndConfig
from server.layout import Layout, plan_engines, weight_bytes
from server.openmp import openmp_env
from server.procs import start_tied
from server.supervisor import Supervisor

logger = logging.getLogger("pdserve")

KV_PREFIX = "kv-"  # KVTransferConfig.lease_s is --kv-lease-s
# `pdserve serve` places its engines' KV ports itself (ipc:// in its private folder) and keeps the
# deadlines' defaults: of the KV settings it takes only how the KV travels.
SERVE_KV_FIELDS = ("key", "checksum", "mode", "layerwise_min_tokens")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings the flags give; what an engine's role changes is EngineConfig.for_role's."""
    return from_args(EngineConfig, args)


def kv_config(args: argparse.Namespace) -> KVTransferConfig:
    return from_args(KVTransferConfig, args, KV_PREFIX)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """Re-emit the engine flags for a child process."""
    return to_argv(args, EngineConfig)


# -- commands ----------------------------------------------------------------------------------

def cmd_engine(args: argparse.Namespace) -> None:
    from engine.process import run_engine_process

    name = args.name or f"{args.command}-{socket.gethostname()}"
    health = None
    if args.health_port is not None:
        from engine.health import HealthServer

        # Started before the model loads so probes get a clear 503 "starting" rather than a refused connection.
        health = HealthServer(args.health_port, role=args.command, name=name).start()
    run_engine_process(args.command, engine_config(args), name, args.server_addr, kv_config(args),
                       on_engine=health.attach if health else None, register_timeout_s=args.register_timeout_s)


def run_front_end(args: argparse.Namespace, bind_addr: str, mode: str, cluster_key: ClusterKey | None = None,
                  extra_counters: Callable[[], dict[str, float]] | None = None) -> None:
    import asyncio

    import uvicorn

    from engine.tokenizer import load_tokenizer
    from server.app import build_app
    from server.limits import HTTPLimits, raise_open_files_limit
    from server.pd_client import RemoteEngineClient

    fe = from_args(FrontEndConfig, args)
    model = args.model or default_model()
    model_cfg = ModelConfig.from_dir(model)
    max_model_len = args.max_model_len or default_max_model_len(model_cfg)
    client = RemoteEngineClient(bind_addr, mode, max_model_len, model_cfg.vocab_size, model_cfg.eos_token_ids,
                                dead_after_s=fe.dead_after_s, max_resumes=fe.max_resumes,
                                resume_wait_s=fe.resume_wait_s, local_prefill_above=fe.local_prefill_above,
                                stall_dead_after_s=fe.stall_dead_after_s, cluster_key=cluster_key,
                                extra_counters=extra_counters)
    raise_open_files_limit()
    app = build_app(client, load_tokenizer(model), fe.served_model_name or Path(model).name,
                    api_key=fe.api_key or None, grammar_timeout_s=fe.grammar_timeout_s,
                    max_grammar_bytes=fe.max_grammar_bytes, limits=from_args(HTTPLimits, args))
    config = uvicorn.Config(app, host=fe.host, port=fe.port, log_level="warning", timeout_graceful_shutdown=2)
    asyncio.run(uvicorn.Server(config).serve())


def cmd_server(args: argparse.Namespace) -> None:
    run_front_end(args, args.bind_addr, args.mode)


def engine_cpus(index: int, threads: int, cores: list[int]) -> set[int]:
    """The cores engine `index` is pinned to: `threads` consecutive ones, engines side by side,
    so that with one thread each on two cores P and D (or the engine and the front end, which
    stays unpinned and takes what is left) never share a core's caches and run queue."""
    start = index * threads
    return {cores[(start + k) % len(cores)] for k in range(threads)}


def serve_cluster_key(run_dir: Path) -> tuple[ClusterKey, dict[str, str]]:
    """The user's cluster key if one is set, else a fresh one for this run, written to the private
    run folder for the engines (the environment to give them): only the processes started here
    hold it, so no other local process can register as an engine or pull KV."""
    key = ClusterKey.from_env()
    if key is not None:
        return key, {}
    key = ClusterKey.generate()
    key_file = run_dir / "cluster.key"
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.secret.decode() + "\n")
    return key, {CLUSTER_KEY_FILE_ENV: str(key_file)}


def child_argv(args: argparse.Namespace, role: EngineRole, name: str, server_addr: str, run_dir: Path,
               threads: int) -> list[str]:
    """The command line of one engine child of `pdserve serve`."""
    argv = [sys.executable, "-m", "server.cli", role, "--name", name, "--server-addr", server_addr,
            *engine_argv(args), "--num-threads", str(threads)]
    if role == EngineRole.PREFILL:
        argv += ["--kv-addr", f"ipc://{run_dir}/{name}-kv"]
    if role == EngineRole.DECODE:  # the last --max-num-batched-tokens wins
        budget = min(args.max_num_batched_tokens, args.decode_max_num_batched_tokens)
        argv += ["--max-num-batched-tokens", str(budget)]
    return argv + to_argv(args, KVTransferConfig, KV_PREFIX)


def start_child(argv: list[str], env: dict[str, str], cpus: set[int] | None) -> subprocess.Popen:
    # Tied to this process: with the front end gone (even by SIGKILL) nothing would ever stop it.
    proc = start_tied(argv, cwd=Path(__file__).resolve().parents[1], env=env)
    if cpus is not None:
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def cmd_serve(args: argparse.Namespace) -> None:
    """Front end + engine children on one host, talking over ipc:// sockets in a private folder."""
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-"))
    server_addr = f"ipc://{run_dir}/frontend"
    cluster_key, env_key = serve_cluster_key(run_dir)
    plan = plan_engines(args.mode, len(os.sched_getaffinity(0)), args.num_prefill, args.num_decode,
                        weight_bytes(args.model or default_model()), args.num_threads)
    role_threads = {EngineRole.PREFILL: args.prefill_threads} if args.prefill_threads else {}
    supervisor = Supervisor()  # restarts an engine that exits unexpectedly
    # Engine health ports are for engines deployed one per container; here every child would
    # inherit the same port and all but one would fail to bind it. The front end's /health covers them.
    env = engine_env({k: v for k, v in os.environ.items() if k != settings.flag_env_name("--health-port")} | env_key)
    cores = sorted(os.sched_getaffinity(0))
    for role, count in plan.roles:
        for i in range(count):
            argv = child_argv(args, role, f"{role}-{i}", server_addr, run_dir, role_threads.get(role, plan.threads))
            cpus = engine_cpus(len(supervisor.children), plan.threads, cores) if args.cpu_affinity == "pin" else None
            supervisor.add(f"{role}-{i}", lambda argv=argv, cpus=cpus: start_child(argv, env, cpus))
    supervisor.start()

    signal.signal(signal.SIGTERM, lambda *_: (supervisor.stop(), sys.exit(0)))
    url = f"http://{args.host}:{args.port}"
    print(f"pdserve: {plan.mode} mode ({plan.why}), {', '.join(f'{n} x {r}' for r, n in plan.roles)}, "
          f"{plan.threads} threads each; serving on {url}; "
          f"engines connect to {server_addr}" + (" with a fresh cluster key" if env_key else "") + "\n"
          f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32, \"temperature\": 0}}'", flush=True)
    try:
        run_front_end(args, server_addr, plan.mode, cluster_key, supervisor.counters)
    except KeyboardInterrupt:
        pass
    finally:
        supervisor.stop()


def cmd_generate(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams

    config = engine_config(args)
    llm = LLM(**vars(config))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for out in llm.generate(args.prompt or ["def fibonacci(n):", "import os\n", "class Stack:"], params):
        print(f"--- {out.finish_reason}, {len(out.token_ids)} tokens\n{out.text}")


def cmd_bench(args: argparse.Namespace) -> None:
    """`pdserve bench ARGS`: the load generator of benchmarks/bench_serving.py with ARGS.

    It is a client of the server, not a part of it, so it is looked up by name when this command
    runs (server/ never imports benchmarks/); `pdserve bench --help` lists its flags."""
    import importlib

    result = importlib.import_module("benchmarks.bench_serving").main(args.bench_args)
    if result["failed"]:
        sys.exit(1)  # scripts and CI notice failed requests without parsing the report


def cmd_keygen(args: argparse.Namespace) -> None:
    """A new cluster key, readable by its owner only. Every process of one deployment (front end,
    prefill, decode) gets the same file as PDSERVE_CLUSTER_KEY_FILE (a mounted secret)."""
    from engine.cluster_key import ClusterKey

    key = ClusterKey.generate()
    path = Path(args.path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.secret.decode() + "\n")
    print(f"pdserve: wrote the cluster key to {path}; set PDSERVE_CLUSTER_KEY_FILE={path} for every process")


def add_keygen(sub) -> None:
    keygen = sub.add_parser("keygen", help="write a new cluster key file (CURVE) for PDSERVE_CLUSTER_KEY_FILE")
    keygen.add_argument("path")
    keygen.set_defaults(func=cmd_keygen)


def add_front_end_flags(p: argparse.ArgumentParser) -> None:
    from server.limits import HTTPLimits

    add_flags(p, FrontEndConfig)
    add_flags(p, HTTPLimits)  # bounds on clients (server/limits.py: why each default is far from a fair client's)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="front end + engines on this host")
    add_engine_flags(serve)
    add_front_end_flags(serve)
    add_flag(serve, "--mode", Layout, Layout.AUTO, "auto | pd | colocated: auto splits prefill and decode "
             "only where each engine gets cores of its own (server/layout.py)")
    add_flag(serve, "--num-prefill", int, 1, "prefill engine processes")
    add_flag(serve, "--num-decode", int, 1, "decode engine processes")
    add_flags(serve, KVTransferConfig, KV_PREFIX, SERVE_KV_FIELDS, say_role=False)
    add_flag(serve, "--cpu-affinity", str, "none", "pin | none: pin each engine process to its own cores")
    add_flag(serve, "--prefill-threads", int, None, "torch threads of each prefill engine (default: --num-threads)")
    add_flag(serve, "--decode-max-num-batched-tokens", int, 1024, "PD: token budget of a decode engine's step, "
             "which bounds the chunk of a prompt prefilled there (--local-prefill-above) and so its streams' ITL")
    serve.set_defaults(func=cmd_serve)

    for role in (EngineRole.PREFILL, EngineRole.DECODE, EngineRole.COLOCATED):
        p = sub.add_parser(role, help=f"one {role} engine process")
        add_engine_flags(p)
        add_flag(p, "--name", str, None, f"unique instance name (default {role}-HOSTNAME)")
        add_flag(p, "--server-addr", str, "tcp://127.0.0.1:5500", "connect: the front end's engine socket")
        add_flags(p, KVTransferConfig, KV_PREFIX)
        add_flag(p, "--health-port", int, None, "serve GET /health on this port (0.0.0.0) for probes; off by default")
        add_flag(p, "--register-timeout-s", float, 60.0, "exit (status 3) when the front end has not accepted this "
                 "engine's handshake by then (no or wrong cluster key, wrong address); a front end lost later is "
                 "waited for without limit")
        p.set_defaults(func=cmd_engine)

    server = sub.add_parser("server", help="the HTTP front end alone, for engines started elsewhere")
    add_engine_flags(server)
    add_front_end_flags(server)
    add_flag(server, "--bind-addr", str, "tcp://127.0.0.1:5500", "bind: the socket engines connect to")
    add_flag(server, "--mode", ServeMode, ServeMode.PD, "pd | colocated: which engine roles must be present")
    server.set_defaults(func=cmd_server)

    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server (vLLM `bench serve` metrics)",
                           description="Flags read PDSERVE_BENCH_<FLAG> from the environment.", add_help=False)
    bench.set_defaults(func=cmd_bench)  # its flags are benchmarks/bench_serving.py's: see parse_args

    add_keygen(sub)
    gen = sub.add_parser("generate", help="offline generation, no server")
    add_engine_flags(gen)
    gen.add_argument("--prompt", action="append")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=cmd_generate)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Every command's flags; `bench` passes whatever follows it on to the load generator."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> None:
    # Must be set before torch starts OpenMP, i.e. before anything imports torch.
    os.environ.update(openmp_env(os.environ))
    args = parse_args(argv)
    logging.basicConfig(level=settings.LOG_LEVEL.get(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.func is cmd_engine and argv is None:  # a standalone engine process (not called in-process)
        reexec_with_tcmalloc()
    args.func(args)


if __name__ == "__main__":
    main()
