"""server/flags.py: the command-line flags generated from EngineConfig, KVTransferConfig and HTTPLimits keep
the names and defaults the hand-written table had, mirror PDSERVE_<FLAG>, and a child process of
`pdserve serve` parses its command line back into the same settings."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from engine.config import EngineConfig, KVTransferConfig
from engine.types import EngineRole, KVTransferMode, ServeMode
from server import cli
from server.flags import flags_of, from_args
from server.layout import Layout
from server.limits import HTTPLimits

# Every flag and its default as `main` had them before the flags were generated (bench and keygen aside).
ENGINE = {
    "--model": None, "--max-num-seqs": 64, "--max-num-batched-tokens": 2048, "--max-model-len": None,
    "--block-size": 16, "--num-kv-blocks": None, "--kv-memory-fraction": 0.05, "--dtype": "float32",
    "--quantization": "none", "--device": "cpu", "--seed": 0, "--speculative-method": "auto",
    "--num-speculative-tokens": 2, "--spec-policy": "adaptive", "--draft-dtype": "auto", "--mtp-window": 32,
    "--draft-vocab": "auto", "--num-threads": None, "--enable-prefix-caching": True, "--enforce-eager": None,
}
FRONT_END = {
    "--host": "127.0.0.1", "--port": 8000, "--api-key": "", "--body-read-timeout-s": 60.0,
    "--max-in-flight-per-client": 384, "--max-in-flight-per-key": 384, "--max-response-entries": 524288,
    "--max-stream-backlog": 65536, "--served-model-name": None, "--dead-after-s": 3.0, "--stall-dead-after-s": 900.0,
    "--max-resumes": 3, "--resume-wait-s": 20.0, "--grammar-timeout-s": 10.0, "--max-grammar-bytes": 1048576,
    "--local-prefill-above": 1024,
}
KV_PAYLOAD = {"--kv-key": "", "--kv-checksum": False, "--kv-transfer-mode": KVTransferMode.LAYERWISE,
              "--kv-layerwise-min-tokens": 512}
ENGINE_PROCESS = {
    "--name": None, "--server-addr": "tcp://127.0.0.1:5500", "--kv-addr": "", "--kv-advertise": "",
    "--kv-lease-s": 30.0, "--kv-deadline-s": 30.0, "--kv-reserve-deadline-s": 20.0, **KV_PAYLOAD,
    "--health-port": None, "--register-timeout-s": 60.0,
}
MAIN_FLAGS = {
    "serve": {**ENGINE, **FRONT_END, "--mode": Layout.AUTO, "--num-prefill": 1, "--num-decode": 1, **KV_PAYLOAD,
              "--cpu-affinity": "none", "--prefill-threads": None, "--decode-max-num-batched-tokens": 1024},
    **{role: {**ENGINE, **ENGINE_PROCESS} for role in ("prefill", "decode", "colocated")},
    "server": {**ENGINE, **FRONT_END, "--bind-addr": "tcp://127.0.0.1:5500", "--mode": ServeMode.PD},
    "generate": {**ENGINE, "--prompt": None, "--max-tokens": 48, "--temperature": 0.0},
}
# Where the command line's default differs from the Python API's (the field's), on purpose.
CLI_DEFAULTS = {"model": None, "quantization": "none", "speculative_method": "auto"}


@pytest.fixture
def clean_env(monkeypatch):
    """No PDSERVE_* variable set: flag defaults are read from the environment when the parser is built."""
    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        monkeypatch.delenv(name)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_command_keeps_its_flags_and_their_defaults(clean_env):
    for command, want in MAIN_FLAGS.items():
        parser = subparsers()[command]
        got = {a.option_strings[0]: a.default for a in parser._actions if a.option_strings and a.dest != "help"}
        assert got == want, command
        listed = parser.format_help()
        assert all(flag in listed for flag in want), command


def test_flag_defaults_are_the_dataclass_defaults(clean_env):
    for cls, prefix in ((EngineConfig, ""), (KVTransferConfig, cli.KV_PREFIX), (HTTPLimits, "")):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for flag in flags_of(cls, prefix):
            f = fields[flag.field]
            own = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert flag.default == CLI_DEFAULTS.get(flag.field, own), flag.name
    assert {f.name for f in dataclasses.fields(EngineConfig) if "default" in f.metadata} == set(CLI_DEFAULTS)
    args = cli.parse_args(["prefill"])
    assert cli.engine_config(args) == EngineConfig(quantization="none", speculative_method="auto")
    assert cli.kv_config(args) == KVTransferConfig()
    assert from_args(HTTPLimits, cli.parse_args(["server"])) == HTTPLimits()


def test_flags_mirror_their_environment_variables_and_the_flag_wins(clean_env, monkeypatch):
    env = {"PDSERVE_MAX_NUM_SEQS": "8", "PDSERVE_ENABLE_PREFIX_CACHING": "0", "PDSERVE_KV_CHECKSUM": "1",
           "PDSERVE_KV_TRANSFER_MODE": "after-prefill", "PDSERVE_KV_LEASE_S": "2.5", "PDSERVE_MTP_WINDOW": "0"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = cli.parse_args(["prefill"])
    config, kv = cli.engine_config(args), cli.kv_config(args)
    assert (config.max_num_seqs, config.enable_prefix_caching, config.mtp_window) == (8, False, 0)
    assert (kv.checksum, kv.mode, kv.lease_s) == (True, KVTransferMode.AFTER_PREFILL, 2.5)
    args = cli.parse_args(["prefill", "--max-num-seqs", "4", "--enable-prefix-caching", "--kv-lease-s", "1"])
    assert cli.engine_config(args).max_num_seqs == 4 and cli.engine_config(args).enable_prefix_caching
    assert cli.kv_config(args).lease_s == 1.0


@pytest.mark.parametrize("flags", [
    [],
    ["--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager", "--speculative-method", "ngram",
     "--quantization", "int8", "--mtp-window", "0", "--kv-memory-fraction", "0.125", "--model", "/m",
     "--kv-checksum", "--kv-transfer-mode", "after-prefill", "--kv-layerwise-min-tokens", "7", "--kv-key=-k y",
     "--max-num-batched-tokens", "512", "--decode-max-num-batched-tokens", "256"],
])
def test_serve_children_parse_back_to_the_same_settings(clean_env, flags):
    args = cli.parse_args(["serve", *flags])
    run_dir = Path("/tmp/pdserve-test")
    for role in (EngineRole.PREFILL, EngineRole.DECODE):
        argv = cli.child_argv(args, role, f"{role}-0", "ipc:///tmp/fe", run_dir, threads=3)
        assert argv[:3] == [sys.executable, "-m", "server.cli"]
        child = cli.parse_args(argv[3:])
        assert child.command == role
        budget = min(args.max_num_batched_tokens, args.decode_max_num_batched_tokens)
        want = dataclasses.replace(cli.engine_config(args), num_threads=3,
                                   **({"max_num_batched_tokens": budget} if role == EngineRole.DECODE else {}))
        assert cli.engine_config(child) == want
        addr = f"ipc://{run_dir}/{role}-0-kv" if role == EngineRole.PREFILL else ""
        assert cli.kv_config(child) == dataclasses.replace(cli.kv_config(args), addr=addr)


def test_the_role_decides_drafting_in_one_place():
    mtp = EngineConfig(speculative_method="mtp", num_speculative_tokens=3)
    prefill = mtp.for_role(EngineRole.PREFILL)
    assert (prefill.speculative_method, prefill.num_speculative_tokens, prefill.proposes_drafts) == ("mtp", 1, False)
    for role in (EngineRole.DECODE, EngineRole.COLOCATED):
        assert mtp.for_role(role) == mtp and mtp.for_role(role).proposes_drafts
    assert EngineConfig(speculative_method="auto").for_role(EngineRole.PREFILL).num_speculative_tokens == 1
    ngram = EngineConfig(speculative_method="ngram", num_speculative_tokens=3).for_role(EngineRole.PREFILL)
    assert (ngram.speculative_method, ngram.num_speculative_tokens, ngram.proposes_drafts) == (None, 3, False)
    assert EngineConfig(speculative_method="none").for_role(EngineRole.PREFILL).speculative_method is None
