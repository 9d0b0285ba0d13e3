"""EngineClient over ZMQ: routes each request to engine processes (a P and a D, or one colocated).

The front end binds one ROUTER socket, run with the engines' liveness by a thread of its own
(server/engine_router.py). Every engine connects a DEALER to it under its instance name and
heart-beats; that is how instances are discovered, on any host and in any number, and how dead
ones drop out and come back. Routing: P and D each chosen on its own by load, pairs whose
transfers keep failing avoided (server/placement.py). Failures end in a retry (fresh prefill on
another P) or a clear error, never a hang.

Failover (docs/architecture.md, failover): the front end keeps every token it streamed. When an
instance holding a request dies (or fails it with a retryable error) after tokens reached the
client, the request is resumed: prompt + streamed tokens go to a live P, which computes the KV of
all but the last streamed token and hands that token to a live D as its t0, under a new transfer
id; D continues at the next output index, so the client's stream goes on with nothing repeated or
missing. With no live instance of a needed role it waits for one up to `resume_wait_s`;
`max_resumes` bounds the resumes of one request, so a request that crashes every D it lands on
stops with a clear error.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

from engine import messages as msg
from engine.cluster_key import ClusterKey
from engine.types import EngineRole, FinishReason, SamplingParams, ServeMode
from engine.validation import check_prompt
from server.engine_router import Arrival, EngineRouter, EngineState, Instance
from server.placement import Placement
from server.protocol import EngineUnavailableError, GenerationChunk, InstanceInfo
from server.timeline import Timeline

logger = logging.getLogger(__name__)


@dataclass
class Attempt:
    """One dispatch of a request: the instances it runs on and its KV transfer. A retry or a resume
    starts a new one, so nothing of a failed attempt carries over."""
    prefill: str | None = None    # None (both) once the attempt ended: its late outputs are dropped
    decode: str | None = None
    transfer_id: str = ""         # the attempt's KV transfer, on P and D alike
    decode_started: bool = False  # D produced output: P's part is over
    early: dict[int, Arrival] = field(default_factory=dict)  # outputs that arrived ahead of their turn
    first_from_prefill: float | None = None  # when P's t0 arrived, and D's first tokens: the hand-off
    first_from_decode: float | None = None


@dataclass
class Tracked:
    """A request the front end routes, across all its attempts."""
    req_id: str
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    attempt: Attempt = field(default_factory=Attempt)
    streamed: list[int] = field(default_factory=list)  # tokens delivered to the client: the resume point
    next_index: int = 0           # outputs delivered so far
    attempts: int = 0             # retries before any token reached the client (a fresh prefill)
    resumes: int = 0              # re-dispatches after tokens reached the client (failover)
    failed_at: float | None = None       # when the failure being recovered from was seen
    redispatch_by: float | None = None   # waiting for a live instance until then (monotonic)
    failure: str = ""                    # what the request is recovering from, for the final error


class RemoteEngineClient:
    def __init__(self, bind_addr: str, mode: ServeMode, max_model_len: int, vocab_size: int, eos_token_ids: list[int],
                 dead_after_s: float = 3.0, max_retries: int = 1, cluster_key: ClusterKey | None = None,
                 max_resumes: int = 3, resume_wait_s: float = 20.0, local_prefill_above: int = 0,
                 stall_dead_after_s: float = 900.0, forget_after_s: float = 60.0,
                 extra_counters: Callable[[], dict[str, float]] | None = None) -> None:
        """`cluster_key` (default: from PDSERVE_CLUSTER_KEY[_FILE]) makes the engine socket CURVE-only.
        `max_retries`: fresh prefills of a request that failed before its first token reached the
        client; `max_resumes`: resumes of one that failed after (0 turns failover off);
        `resume_wait_s`: how long either waits for a live instance of the role it needs.
        `local_prefill_above`: conditional disaggregation (0: off), see `_prefill_on_decode`.
        `dead_after_s`: an engine silent this long is dead; `stall_dead_after_s`: one whose step has
        run this long is too; `forget_after_s`: a dead one leaves /status after this long.
        `extra_counters`: more front-end counters for /metrics (`pdserve serve`'s engine restarts)."""
        self.bind_addr = bind_addr
        self.cluster_key = cluster_key or ClusterKey.from_env()
        self.router = EngineRouter(bind_addr, self.cluster_key, dead_after_s, stall_dead_after_s, self._on_outputs)
        self.table: dict[str, Instance] = self.router.table
        self.placement = Placement()
        self.forget_after_s = forget_after_s
        self.extra_counters = extra_counters
        self.mode = ServeMode(mode)
        self.max_model_len, self.vocab_size, self.eos_token_ids = max_model_len, vocab_size, eos_token_ids
        self.max_retries = max_retries
        self.max_resumes, self.resume_wait_s = max_resumes, resume_wait_s
        self.local_prefill_above = local_prefill_above
        self.num_local_prefills = 0         # PD requests prefilled on their decode instance (P was queued up)
        self.num_resumed = 0                # requests resumed after tokens reached the client (each resume)
        self.num_retried = 0                # fresh prefills of requests that failed before their first token
        self.num_failed_after_resume = 0    # resumed requests that still ended in an error
        self.resume_recovery_s: list[float] = []  # failure seen -> next token streamed, per resume (recent)
        self.redispatching: dict[str, Tracked] = {}  # failed requests waiting for a live instance
        self.tracked: dict[str, Tracked] = {}
        self._tasks: list[asyncio.Task] = []
        self.timeline = Timeline()  # recent requests, for /status

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self.router.start()
        self._tasks = [asyncio.create_task(self._watch_instances())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.router.stop()

    @property
    def refused_connections(self) -> int:
        """Handshakes refused on the engine socket (no or wrong cluster key)."""
        return self.router.refused_connections

    def counters(self) -> dict[str, float]:
        """The front end's own counters, for /metrics."""
        return {"engine_connections_refused": float(self.router.refused_connections),
                "engines_declared_dead_total": float(self.router.deaths),
                "engine_stalls_total": float(self.router.stalls),
                "requests_resumed_total": float(self.num_resumed),
                "requests_retried_total": float(self.num_retried),
                "requests_failed_after_resume_total": float(self.num_failed_after_resume),
                "requests_prefilled_on_decode_total": float(self.num_local_prefills),
                **self.placement.counters(), **(self.extra_counters() if self.extra_counters else {})}

    # -- EngineClient --------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        check_prompt(prompt_token_ids, self.vocab_size, self.max_model_len)
        if request_id in self.tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        tracked = Tracked(request_id, list(prompt_token_ids), params, asyncio.Queue())
        self._dispatch(tracked)  # raises EngineUnavailableError when no instance can take it
        self.tracked[request_id] = tracked
        finished = False
        try:
            while True:
                chunk = await tracked.queue.get()
                finished = chunk.finish_reason is not None
                if finished:
                    self.timeline.finished(request_id, chunk.finish_reason, chunk.error)
                yield chunk
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)
            self._forget(tracked)

    async def abort(self, request_id: str) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return
        for name in {tracked.attempt.prefill, tracked.attempt.decode} - {None}:
            self._send(name, msg.Abort(request_id, tracked.attempt.transfer_id))
        self._forget(tracked)

    def is_ready(self) -> bool:
        roles = {i.role for i in self.router.instances() if i.routable}
        if self.mode == ServeMode.PD:
            return {EngineRole.PREFILL, EngineRole.DECODE} <= roles
        return EngineRole.COLOCATED in roles

    def instances(self) -> list[InstanceInfo]:
        out = []
        for inst in self.router.instances():
            hb = inst.heartbeat
            out.append(InstanceInfo(
                name=inst.name, role=inst.role, ready=inst.routable, state=str(inst.state),
                kv_blocks_free=hb.kv_blocks_free if hb else 0, kv_blocks_total=hb.kv_blocks_total if hb else 0,
                num_running=hb.num_running if hb else 0, num_waiting=hb.num_waiting if hb else 0,
                counters=dict(hb.counters) if hb else {}, per_position=dict(hb.per_position) if hb else {},
                step_running_s=hb.busy_s if hb else 0.0))
        return out

    # -- routing -------------------------------------------------------------------------

    def _pick(self, role: EngineRole, exclude: Collection[str] = (), prefill: str | None = None) -> Instance | None:
        candidates = [i for i in self.router.instances() if i.role == role]
        return self.placement.pick(candidates, exclude, prefill)

    def _dispatch(self, tracked: Tracked, avoid: Collection[str] = ()) -> None:
        """Send the request (resumed from `tracked.streamed`, if any) to an instance of each role it
        needs, preferring others than those in `avoid` (the ones that just failed it)."""
        if self.mode != ServeMode.PD:
            inst = self._pick(EngineRole.COLOCATED)
            if inst is None:
                raise EngineUnavailableError("no engine instance is ready")
            return self._dispatch_to(tracked, inst, msg.Submit(tracked.req_id, tracked.prompt, tracked.params))
        p = self._pick(EngineRole.PREFILL, exclude=avoid) or self._pick(EngineRole.PREFILL)
        pname = p.name if p is not None else None
        d = self._pick(EngineRole.DECODE, avoid, pname) or self._pick(EngineRole.DECODE, prefill=pname)
        if p is None or d is None:
            raise EngineUnavailableError(f"no {'prefill' if p is None else 'decode'} instance is ready")
        tracked.attempt.transfer_id = uuid.uuid4().hex[:16]
        if self._prefill_on_decode(tracked, p, d):
            self.num_local_prefills += 1
            return self._dispatch_to(tracked, d, msg.Submit(tracked.req_id, tracked.prompt, tracked.params,
                                                            transfer_id=tracked.attempt.transfer_id))
        tracked.attempt.prefill, tracked.attempt.decode = p.name, d.name
        self.placement.handed_off(p.name, d.name)
        p.outstanding.add(tracked.req_id)
        d.outstanding.add(tracked.req_id)
        # Both at once under one id: D reserves while P prefills (docs/architecture.md, the hand-off).
        # The transfer id tells this attempt's KV from an older attempt's on both sides.
        # A resumed request carries the tokens the client has: P computes the KV of all but the last
        # and hands that one over as t0; D continues after it (engine/request.py, num_handoff_tokens).
        tid, done = tracked.attempt.transfer_id, list(tracked.streamed)
        self._send(d.name, msg.Submit(tracked.req_id, tracked.prompt, tracked.params, p.heartbeat.kv_endpoint, tid,
                                      done))
        self._send(p.name, msg.Submit(tracked.req_id, tracked.prompt, tracked.params, transfer_id=tid,
                                      output_token_ids=done))
        self.timeline.dispatched(tracked.req_id, len(tracked.prompt), p.name, d.name)

    def _dispatch_to(self, tracked: Tracked, inst: Instance, submit: msg.Submit) -> None:
        """The whole request on one instance: colocated, or prefilled on its decode instance."""
        tracked.attempt.prefill = tracked.attempt.decode = inst.name
        inst.outstanding.add(tracked.req_id)
        self._send(inst.name, submit)
        self.timeline.dispatched(tracked.req_id, len(tracked.prompt), inst.name, inst.name)

    def _queued_prefill_tokens(self, inst: Instance) -> int:
        """Prompt tokens of the requests `inst` holds that have not streamed a token yet."""
        pending = (self.tracked.get(r) for r in inst.outstanding)
        return sum(len(t.prompt) for t in pending
                   if t is not None and not t.streamed and t.attempt.prefill == inst.name)

    def _prefill_on_decode(self, tracked: Tracked, p: Instance, d: Instance) -> bool:
        """Conditional disaggregation (as Dynamo does it): when the chosen P already has more than
        `local_prefill_above` prompt tokens waiting, a fresh request is prefilled on its D instead,
        as on a colocated engine, unless that D has at least as much prefill queued itself (the
        request then starts where less is ahead of it). Under a stream of long prompts one P is the
        bottleneck: the queue shows up as TTFT while D idles between decode steps; D's chunked
        prefill costs its running streams some ITL instead."""
        if not self.local_prefill_above or tracked.streamed:
            return False  # a resume keeps the handoff path: D continues from the streamed tokens
        queued_p = self._queued_prefill_tokens(p)
        return queued_p > self.local_prefill_above and self._queued_prefill_tokens(d) < queued_p

    def _recover(self, tracked: Tracked, reason: str, failed: Collection[str]) -> None:
        """The instances `failed` died or failed the request retryably: end this attempt everywhere,
        then a fresh prefill (nothing streamed yet) or a resume (tokens streamed) if the request's
        limit allows, else a clear error to the client."""
        for name in {tracked.attempt.prefill, tracked.attempt.decode} - {None}:
            self._send(name, msg.Abort(tracked.req_id, tracked.attempt.transfer_id))
            if (inst := self.table.get(name)) is not None:
                inst.outstanding.discard(tracked.req_id)
        tracked.attempt = Attempt()  # this one's late outputs are dropped from here on
        if self.mode != ServeMode.PD:
            return self._fail(tracked, reason)
        if tracked.streamed:
            if tracked.resumes >= self.max_resumes:
                return self._fail(tracked, f"{reason}; not resumed again after {tracked.resumes} resume(s) "
                                           f"(limit {self.max_resumes}, --max-resumes)")
            tracked.resumes += 1
            self.num_resumed += 1
        elif tracked.attempts < self.max_retries:
            tracked.attempts += 1
            self.num_retried += 1
        else:
            return self._fail(tracked, reason)
        tracked.failure, tracked.failed_at = reason, time.monotonic()
        tracked.redispatch_by = tracked.failed_at + self.resume_wait_s
        self._redispatch(tracked, avoid=failed)

    def _redispatch(self, tracked: Tracked, avoid: Collection[str] = ()) -> None:
        """Dispatch a failed request again, or keep it waiting for a live instance until its deadline."""
        try:
            self._dispatch(tracked, avoid=avoid)
        except EngineUnavailableError as e:
            if time.monotonic() < tracked.redispatch_by:
                self.redispatching[tracked.req_id] = tracked
                return
            self.redispatching.pop(tracked.req_id, None)
            return self._fail(tracked, f"{tracked.failure}; {e} (waited {self.resume_wait_s:g} s, --resume-wait-s)")
        self.redispatching.pop(tracked.req_id, None)
        what = f"resumed after {len(tracked.streamed)} streamed tokens" if tracked.streamed else "retried"
        logger.warning("request %s: %s; %s on %s + %s", tracked.req_id, tracked.failure, what, tracked.attempt.prefill,
                       tracked.attempt.decode)

    def _fail(self, tracked: Tracked, reason: str) -> None:
        if tracked.resumes:
            self.num_failed_after_resume += 1
        tracked.queue.put_nowait(GenerationChunk([], finish_reason=FinishReason.ERROR, error=reason))

    def _send(self, name: str, message: msg.ToEngine) -> None:
        self.router.send(name, message)

    def _forget(self, tracked: Tracked) -> None:
        self.timeline.finished(tracked.req_id, FinishReason.ABORT)  # unless its stream already ended
        if self.tracked.get(tracked.req_id) is tracked:
            del self.tracked[tracked.req_id]
        if self.redispatching.get(tracked.req_id) is tracked:
            del self.redispatching[tracked.req_id]
        for inst in self.router.instances():
            inst.outstanding.discard(tracked.req_id)

    # -- background tasks ----------------------------------------------------------------

    def _on_outputs(self, arrivals: list[Arrival]) -> None:
        """Outputs from the engines, as the router thread read them (called on the event loop)."""
        for arrival in arrivals:
            self._on_output(arrival)

    def _on_output(self, arrival: Arrival) -> None:
        out = arrival.output
        tracked = self.tracked.get(out.req_id)
        if tracked is None or out.instance not in (tracked.attempt.prefill, tracked.attempt.decode):
            return  # a late message from an aborted attempt
        a = tracked.attempt
        if out.transfer_id and out.transfer_id != a.transfer_id:
            return  # from an older attempt on the same instance
        if out.finish_reason == FinishReason.ERROR and out.retryable:
            # A failed transfer: P's side or D's (no memory in time), so try other instances of both.
            if a.prefill != a.decode and a.prefill and a.decode:
                self.placement.transfer_failed(a.prefill, a.decode)
            self._recover(tracked, out.error or "KV transfer failed", {a.prefill, out.instance} - {None})
            return
        self._note_handoff(a, arrival)
        if out.token_ids and out.first_index != tracked.next_index:
            a.early[out.first_index] = arrival  # D's tokens can overtake t0 from P
            return
        self._deliver(tracked, arrival)
        while tracked.next_index in a.early:
            self._deliver(tracked, a.early.pop(tracked.next_index))

    def _note_handoff(self, a: Attempt, arrival: Arrival) -> None:
        """When P's first token and D's first tokens arrived (PD only): the hand-off time."""
        out = arrival.output
        if not out.token_ids or a.prefill == a.decode:
            return
        if out.instance == a.prefill and a.first_from_prefill is None:
            a.first_from_prefill = arrival.at
        elif out.instance == a.decode and a.first_from_decode is None:
            a.first_from_decode = arrival.at
            if a.prefill:
                self.placement.transfer_succeeded(a.prefill, a.decode)

    def _deliver(self, tracked: Tracked, arrival: Arrival) -> None:
        out, a = arrival.output, tracked.attempt
        tracked.next_index += len(out.token_ids)
        self.timeline.output(tracked.req_id, out.instance, len(out.token_ids))
        tracked.streamed.extend(out.token_ids)
        if out.token_ids and tracked.failed_at is not None:
            self._recovered(tracked)
        handoff = a.prefill != a.decode
        if out.instance == a.decode and handoff and not a.decode_started:
            a.decode_started = True
            if (p := self.table.get(a.prefill)) is not None:
                p.outstanding.discard(tracked.req_id)
        if out.finish_reason and self.mode == ServeMode.PD and handoff and out.instance == a.prefill:
            # Finished on P already (t0 was a stop, or an error): the D reservation is not needed.
            self._send(a.decode, msg.Abort(tracked.req_id, a.transfer_id))
        elif out.finish_reason == FinishReason.ERROR and self.mode == ServeMode.PD and handoff and \
                out.instance == a.decode:
            # D failed it for good (no retry): P may still hold the KV for it; free it now, not at lease end.
            self._send(a.prefill, msg.Abort(tracked.req_id, a.transfer_id))
        if out.finish_reason == FinishReason.ERROR and tracked.resumes:
            self.num_failed_after_resume += 1
        tracked.queue.put_nowait(GenerationChunk(list(out.token_ids), list(out.logprobs), out.finish_reason, out.error,
                                                 queue_time=out.queue_time, prompt_logprobs=out.prompt_logprobs,
                                                 num_cached_tokens=out.num_cached_tokens,
                                                 handoff_s=self._handoff_s(a)))

    @staticmethod
    def _handoff_s(a: Attempt) -> float | None:
        """P's first token -> D's first tokens, once (on the first chunk after both arrived)."""
        p, d = a.first_from_prefill, a.first_from_decode
        if p is None or d is None:
            return None
        a.first_from_prefill = a.first_from_decode = None
        return max(0.0, d - p)

    def _recovered(self, tracked: Tracked) -> None:
        """The first token after a retry or resume reached the client: how long the failure cost it."""
        took = time.monotonic() - tracked.failed_at
        tracked.failed_at = None
        if tracked.resumes:
            self.resume_recovery_s = [*self.resume_recovery_s[-999:], took]
        logger.info("request %s: streaming again %.2f s after %s", tracked.req_id, took, tracked.failure)

    async def _watch_instances(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self._sweep(time.monotonic())

    def _sweep(self, now: float) -> None:
        """Every quarter second: requests waiting for a live instance try again, requests held by
        an instance that died or left fail over, and long-dead instances leave the table. Deaths
        are judged by the router's thread, so this running late never causes one."""
        for tracked in list(self.redispatching.values()):
            self._redispatch(tracked)
        for inst in self.router.instances():
            if inst.state not in (EngineState.DEAD, EngineState.LEFT):
                continue
            for req_id in list(inst.outstanding):
                tracked = self.tracked.get(req_id)
                if tracked is None:
                    inst.outstanding.discard(req_id)
                    continue
                what = "died" if inst.state == EngineState.DEAD else "left"
                self._recover(tracked, f"{inst.role} instance {inst.name} {what} ({inst.why})", {inst.name})
            if not inst.outstanding and now - inst.since > self.forget_after_s:
                self.table.pop(inst.name, None)
                logger.info("engine %s forgotten after %g s %s", inst.name, self.forget_after_s, inst.state)
