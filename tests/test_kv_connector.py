"""The scheduler's side of the KV-connector seam, without a model: decode-role reservations go
through WAITING_FOR_KV inside `schedule()`, and a connector that keeps a finished request's
blocks owns them (they are not freed twice)."""
from __future__ import annotations

from engine.request import DecodeHandoff, PrefillHandoff, Request, RequestStatus
from engine.types import FinishReason, SamplingParams
from kv_transfer.connector import KVConnector
from scheduler.block_manager import BlockManager
from scheduler.output import RunnerOutput
from scheduler.scheduler import Scheduler

BLOCK = 4


class RecordingConnector(KVConnector):
    """Decode-like: every request's KV comes from "p"; remembers what the scheduler asked."""

    def __init__(self, keep_finished: bool = False) -> None:
        self.loads: list[str] = []
        self.finished: list[tuple[str, FinishReason | None]] = []
        self.keep_finished = keep_finished

    def on_new_request(self, request: Request, kv_endpoint: str) -> None:
        if kv_endpoint:
            request.handoff = DecodeHandoff(request, kv_endpoint)

    def start_load(self, request: Request) -> None:
        self.loads.append(request.req_id)

    def request_finished(self, request: Request) -> bool:
        self.finished.append((request.req_id, request.finish_reason))
        return self.keep_finished


def make(num_blocks: int, connector: KVConnector) -> tuple[Scheduler, BlockManager]:
    blocks = BlockManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_manager=blocks,
                     connector=connector), blocks


def add(sched: Scheduler, connector: KVConnector, req_id: str, prompt_len: int, endpoint: str = "p") -> Request:
    request = Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4, ignore_eos=True))
    connector.on_new_request(request, endpoint)
    sched.add_request(request)
    return request


def test_decode_reservation_waits_for_kv_then_runs_first():
    conn = RecordingConnector()
    sched, blocks = make(8, conn)
    local = add(sched, conn, "local", 3, endpoint="")   # no remote KV: an ordinary request
    assert [n.req_id for n in sched.schedule().new_requests] == ["local"]
    remote = add(sched, conn, "remote", 6)
    out = sched.schedule()
    # The remote request got blocks for prompt + t0 and a pull; it is not scheduled itself.
    assert conn.loads == ["remote"] and remote.status == RequestStatus.WAITING_FOR_KV
    assert len(remote.block_ids) == blocks.blocks_needed(6 + 1)
    assert not out.new_requests
    sched.running.clear()
    assert not sched.has_unfinished()  # waiting for KV is no work for a step
    sched.running.append(local)
    sched.kv_loaded("remote", t0=99, num_tokens=6)
    assert remote.status == RequestStatus.WAITING and remote.output_token_ids == [99]
    assert sched.waiting[0] is remote  # holds memory: runs first
    out = sched.schedule()
    new = {n.req_id: n for n in out.new_requests}
    assert new["remote"].num_computed_tokens == 6 and new["remote"].all_token_ids[-1] == 99
    assert out.num_scheduled_tokens["remote"] == 1  # only t0 is left to compute
    assert local.status == RequestStatus.RUNNING


def test_no_new_reservation_while_a_preempted_request_waits_for_memory():
    conn = RecordingConnector()
    sched, _ = make(8, conn)
    hog = Request("hog", [1] * 20, SamplingParams())
    sched.blocks.allocate(hog, 20)  # 5 of the 8 blocks taken
    add(sched, conn, "starved", 16, endpoint="")  # waiting without blocks, as after a preemption: needs 4
    add(sched, conn, "remote", 3)                 # would fit in the 3 blocks left
    sched.schedule()
    assert conn.loads == []  # memory goes to the preempted request first
    sched.blocks.free_request(hog)
    assert [n.req_id for n in sched.schedule().new_requests] == ["starved"]
    sched.schedule()  # nothing waits without blocks any more: the reservation goes ahead
    assert conn.loads == ["remote"]


def test_failed_transfer_frees_the_reservation_and_reports_a_retryable_error():
    conn = RecordingConnector()
    sched, blocks = make(8, conn)
    add(sched, conn, "remote", 6)
    sched.schedule()
    assert blocks.num_free_blocks < 8
    update = sched.kv_failed("remote", "prefill went away")
    assert update.finish_reason == FinishReason.ERROR and update.retryable and update.error == "prefill went away"
    assert blocks.num_free_blocks == 8 and "remote" not in sched.requests


def test_blocks_kept_by_the_connector_are_not_freed_by_the_scheduler():
    conn = RecordingConnector(keep_finished=True)
    sched, blocks = make(8, conn)
    request = add(sched, conn, "p1", 6, endpoint="")
    request.handoff = PrefillHandoff(request)  # prefill role: stop after t0
    out = sched.schedule()
    updates = sched.update_from_output(out, RunnerOutput(["p1"], [[42]], [[]]))
    assert conn.finished == [("p1", FinishReason.HANDED_OFF)]
    # For the client the request goes on elsewhere: t0 is sent, with no finish reason.
    assert [(u.new_token_ids, u.finish_reason) for u in updates] == [([42], None)]
    assert blocks.num_free_blocks == 8 - blocks.blocks_needed(6) and request.block_ids == []


def test_prompts_whose_steps_are_long_stream_their_layers_whatever_their_length():
    """Below layerwise_min_tokens a prompt's KV goes whole, after its prefill -- unless the engine
    predicts its step to be long (a large model), where waiting for the next step would be the
    hand-off."""
    from kv_transfer.connector import LAYERWISE_MIN_STEP_S, PrefillConnector

    class Sender:
        def supersede(self, req_id, transfer_id):
            pass

    conn = PrefillConnector(Sender(), "", layerwise_min_tokens=512)  # type: ignore[arg-type]
    for name, length in (("short", 200), ("long", 600)):
        conn.on_new_request(Request(name, [1] * length, SamplingParams(max_tokens=4), []), "")
    assert not conn.snapshots("short") and conn.snapshots("long")  # nothing predicted yet
    conn.step_seconds = lambda tokens: tokens * 1e-5  # a small model: 2 ms
    assert not conn.snapshots("short")
    conn.step_seconds = lambda tokens: LAYERWISE_MIN_STEP_S + tokens * 0.01  # a large one
    assert conn.snapshots("short") and not conn.snapshots("unknown")
    assert not PrefillConnector(Sender(), "", layerwise_min_tokens=None).snapshots("short")  # type: ignore[arg-type]
