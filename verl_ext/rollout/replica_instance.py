"""``Instance`` over one veRL rollout server (``vLLMHttpServer`` / ``SGLangHttpServer`` Ray actor).

veRL's servers expose ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``, 0.9.1). The request's original veRL
sampling dict travels in ``GenRequest.extra["verl_sampling_params"]`` and is passed through
unchanged, except ``max_tokens`` when a strategy generates the request in chunks, so routing
through verl_ext never changes what the engine samples.

When the servers run verl_ext's vLLM drafter (``drafting``), each request also carries its group
and prompt key in ``SamplingParams.extra_args["verl_ext"]`` (read only by the drafter, for group
and history drafts), and ``drafter_call`` reaches the drafter through veRL's public
``vLLMHttpServer.collective_rpc`` (which returns nothing: calls are fire-and-check, errors raise).
``import_drafts`` takes the grouped draft server's deltas that way; veRL's servers do not stream,
so ``generate`` hands a chunk's tokens to ``on_tokens`` (and so to the draft server) when the
chunk ends.
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

from verl_ext.engine.instance import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    GenRequest,
    Instance,
    Telemetry,
    chunk_seed,
)

SAMPLING_KEY = "verl_sampling_params"
KWARGS_KEY = "verl_generate_kwargs"
TOKEN_OUTPUT_KEY = "token_output"


class ReplicaInstance(Instance):
    def __init__(self, name: str, handle: Any, max_tokens_default: Optional[int] = None,
                 max_running: Optional[int] = None, drafting: bool = False, versions: Optional[dict] = None):
        """``max_running``: the server's ``max_num_seqs`` (veRL's rollout config), for strategies
        that keep each replica below the concurrency at which it would queue or preempt.
        ``drafting``: the server is vLLM with verl_ext's drafter (see the module docstring).
        ``versions``: request id -> oldest weight version (``global_steps``) any of its outputs
        reported, shared by the dispatcher's instances (a request's chunks may span a weight sync)."""
        self.name = name
        self.versions = versions
        self.drafting = drafting
        self.max_running = max_running
        self.handle = handle
        self.max_tokens_default = max_tokens_default
        self._engine_ids: dict[str, str] = {}
        self._inflight = 0
        self._generated = 0

    def _sampling(self, request: GenRequest) -> dict:
        params = dict(request.extra.get(SAMPLING_KEY) or {})
        original = params.get("max_tokens", params.get("max_new_tokens", self.max_tokens_default))
        if original is None or request.sampling.max_tokens < original:
            params.pop("max_new_tokens", None)
            params["max_tokens"] = request.sampling.max_tokens
        chunk = int(request.extra.get("chunk", 0))
        if chunk and params.get("seed") is not None:  # chunks do not replay one random stream
            params["seed"] = chunk_seed(int(params["seed"]), chunk)
        if self.drafting:
            extra_args = dict(params.get("extra_args") or {})
            extra_args["verl_ext"] = {"group_id": request.group_id, "prompt_key": request.group_id}
            params["extra_args"] = extra_args
        return params

    async def drafter_call(self, op: str, *args) -> None:
        """Call the servers' drafter (``verl_ext.spec.vllm_proposer`` RPC ops) on every worker."""
        if not self.drafting:
            raise RuntimeError(f"server {self.name} runs no verl_ext drafter")
        await self.handle.collective_rpc.remote("verl_ext_drafter", args=(op, *args))

    async def import_drafts(self, blobs: list) -> bool:
        """Import grouped draft server deltas (``verl_ext.spec.dgds``) into the server's drafter.
        ``collective_rpc`` returns nothing, so the import is strict: True when every worker took
        every delta, False when one was refused (the client then resends those groups in full);
        other errors raise (the client retries, then stops pushing to this server)."""
        from verl_ext.spec.dgds import IMPORT_REFUSED

        try:
            await self.drafter_call("import_groups", list(blobs), True)
        except Exception as exc:
            if IMPORT_REFUSED in str(exc):
                return False
            raise
        return True

    async def generate(self, request: GenRequest, on_tokens=None) -> Completion:
        engine_id = uuid.uuid4().hex  # veRL sends a fresh id per turn, too
        self._engine_ids[request.request_id] = engine_id
        self._inflight += 1
        try:
            output = await self.handle.generate.remote(
                prompt_ids=list(request.prompt_ids),
                sampling_params=self._sampling(request),
                request_id=engine_id,
                **(request.extra.get(KWARGS_KEY) or {}),
            )
        finally:
            self._inflight -= 1
            self._engine_ids.pop(request.request_id, None)
        tokens = list(output.token_ids)
        self._generated += len(tokens)
        version = output.extra_fields.get("global_steps")
        if self.versions is not None and version is not None:
            rid = request.request_id
            self.versions[rid] = min(self.versions.get(rid, version), version)
        if on_tokens is not None and tokens:
            on_tokens(tokens)  # veRL's server does not stream: one delta at the end
        if output.stop_reason in ("aborted", "abort"):
            reason = FINISH_ABORT
        elif len(tokens) >= request.sampling.max_tokens:
            reason = FINISH_LENGTH
        else:
            reason = FINISH_STOP
        return Completion(request.request_id, tokens, reason, logprobs=output.log_probs, extra={TOKEN_OUTPUT_KEY: output})

    async def abort(self, request_id: str) -> None:
        engine_id = self._engine_ids.get(request_id)
        if engine_id is not None and hasattr(self.handle, "abort_request"):
            await self.handle.abort_request.remote(engine_id)

    def telemetry(self) -> Telemetry:
        # veRL's servers expose no cheap load probe; in-flight requests are what its own load
        # balancer uses, too.
        return Telemetry(running=self._inflight, generated_tokens=self._generated, max_running=self.max_running)
