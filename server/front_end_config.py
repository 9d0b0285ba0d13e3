"""The front end's settings (`pdserve serve` and `pdserve server`), each a command-line flag
(server/flags.py) and a PDSERVE_<FLAG> variable. The bounds on clients are server/limits.py's
HTTPLimits; the engines' settings are engine/config.py's."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import flag
from engine.grammar import DEFAULT_GRAMMAR_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES


@dataclass(frozen=True)
class FrontEndConfig:
    host: str = field(default="127.0.0.1", metadata=flag("HTTP host"))
    port: int = field(default=8000, metadata=flag("HTTP port"))
    api_key: str = field(default="", metadata=flag(
        "require Authorization: Bearer KEY on /v1/* (several keys: KEY1,KEY2)"))
    served_model_name: str | None = field(default=None, metadata=flag(
        "model name in the API (default: the folder name)"))
    # A heartbeat comes from a thread of the engine (engine/link.py), not between steps: an engine
    # in a step of any length still sends it, so this bound holds for any model.
    dead_after_s: float = field(default=3.0, metadata=flag(
        "declare an engine dead after this long without a heartbeat (sent by a thread of the engine every "
        "0.2 s, whatever its step costs)"))
    stall_dead_after_s: float = field(default=900.0, metadata=flag(
        "declare an engine dead when one of its steps has run this long (a stall, far longer than its recent "
        "steps, is reported on /status and /metrics before that)"))
    max_resumes: int = field(default=3, metadata=flag(
        "failover: resume a request whose engine died mid-stream at most this many times (0: off; the stream "
        "then ends with an error)"))
    resume_wait_s: float = field(default=20.0, metadata=flag(
        "failover: wait this long for a live instance of a role a failed request needs, then end its stream "
        "with an error"))
    grammar_timeout_s: float = field(default=DEFAULT_GRAMMAR_TIMEOUT_S, metadata=flag(
        "structured output: a grammar (JSON schema, tool call) that does not compile within this long is "
        "refused with a 400 (compiled off the event loop)"))
    max_grammar_bytes: int = field(default=DEFAULT_MAX_GRAMMAR_BYTES, metadata=flag(
        "structured output: a larger grammar is refused with a 400 before it is compiled"))
    local_prefill_above: int = field(default=1024, metadata=flag(
        "PD: prefill a request on its decode instance when the prefill instance already has more than this "
        "many prompt tokens queued (0: always on prefill)"))
