"""The plain-transformers baseline for `benchmarks/compare.py`: a minimal OpenAI-style streaming
`/v1/completions` server around `model.generate`, with no engine underneath.

What a naive deployment does: one `generate` call per request, one request on the model at a
time (generate has no continuous batching; interleaving calls would only thrash), tokens streamed
through a `BaseStreamer` as they are produced. Greedy when temperature is 0, `ignore_eos` honoured
(`min_new_tokens`), usage in the final chunk when `stream_options.include_usage` is set — enough
for `pdserve bench` to measure it exactly like pdserve.

    python benchmarks/hf_server.py --model DIR --port 8001 --num-threads 2
"""
# No `from __future__ import annotations`: FastAPI must see the real `Request` class in the route signatures.
import argparse
import asyncio
import json
import logging
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

logger = logging.getLogger("hf_server")


def build_app(model_dir: str, num_threads: int) -> FastAPI:
    import torch
    import transformers

    from engine.tokenizer import load_tokenizer

    torch.set_num_threads(num_threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(model_dir)
    name = Path(model_dir).name
    lock = threading.Lock()  # one generate() at a time: the model has no batching across calls
    app = FastAPI()

    class QueueStreamer(transformers.generation.streamers.BaseStreamer):
        """Hands each new token id to the event loop; the first put() is the prompt, not output."""

        def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
            self.loop, self.queue, self.prompt_seen = loop, queue, False

        def put(self, value) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            for token in value.reshape(-1).tolist():
                self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

        def end(self) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    def run_generate(ids: list[int], body: dict, streamer: QueueStreamer) -> None:
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature") or 0.0)
        kwargs = dict(max_new_tokens=max_tokens, pad_token_id=0, streamer=streamer)
        if body.get("ignore_eos"):
            kwargs.update(min_new_tokens=max_tokens, eos_token_id=None)
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p") or 1.0))
        else:
            kwargs.update(do_sample=False)
        try:
            with lock, torch.no_grad():
                model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kwargs)
        except Exception:
            logger.exception("generate failed")
            streamer.end()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body["prompt"]
        if isinstance(prompt, str):
            if tokenizer is None:
                return JSONResponse({"error": {"message": "this model has no tokenizer: send token ids"}}, 400)
            ids = tokenizer(prompt).input_ids
        else:
            ids = list(prompt)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        streamer = QueueStreamer(loop, queue)
        worker = loop.run_in_executor(None, run_generate, ids, body, streamer)
        req_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str, finish: str | None) -> str:
            return "data: " + json.dumps({"id": req_id, "object": "text_completion", "created": created, "model": name,
                                          "choices": [{"index": 0, "text": text, "finish_reason": finish}]}) + "\n\n"

        async def tokens():
            while (token := await queue.get()) is not None:
                yield token

        if not body.get("stream"):
            out = [t async for t in tokens()]
            await worker
            text = tokenizer.decode(out) if tokenizer is not None else ""
            return {"id": req_id, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                              "total_tokens": len(ids) + len(out)}}

        async def events():
            # The finish reason rides on the last token's chunk, as pdserve's does, so the client sees
            # one chunk per token here too (an extra empty chunk would add a ~0 ms "inter-token" gap).
            n, max_tokens = 0, int(body.get("max_tokens") or 16)
            async for token in tokens():
                n += 1
                yield chunk(tokenizer.decode([token]) if tokenizer is not None else "",
                            "length" if n == max_tokens else None)
            await worker
            if n < max_tokens:  # stopped at EOS: only now is it known that the last token was the last
                yield chunk("", "stop")
            if include_usage:
                yield "data: " + json.dumps({"id": req_id, "object": "text_completion", "created": created,
                                             "model": name, "choices": [],
                                             "usage": {"prompt_tokens": len(ids), "completion_tokens": n,
                                                       "total_tokens": len(ids) + n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--num-threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_app(args.model, args.num_threads), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
