"""``Instance`` over one veRL rollout server (``vLLMHttpServer`` / ``SGLangHttpServer`` Ray actor).

veRL's servers expose ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``, 0.9.1). The request's original veRL
sampling dict travels in ``GenRequest.extra["verl_sampling_params"]`` and is passed through
unchanged, except for a continuation (a chunk, copy or moved request: prompt + tokens so far):
``max_tokens`` is its budget, ``min_tokens`` counts the tokens so far, and a seeded request gets a
derived seed. Repetition penalties see the tokens so far in the prompt, as they would in the
output; presence and frequency penalties cannot, so the dispatcher has such requests generated in
one piece (``verl_ext.pipe.chunks.WHOLE_KEY``). Routing through verl_ext never changes what the
engine samples.

When the servers run verl_ext's vLLM drafter (``drafting``), each request also carries its id,
group and prompt key and the strategy's per-request drafting keys (``spec_window``,
``spec_scopes``: ``REQUEST_DRAFT_KEYS``) in ``SamplingParams.extra_args["verl_ext"]`` (read only
by the drafter), and ``drafter_call`` reaches the drafter through veRL's public
``vLLMHttpServer.collective_rpc`` (which returns nothing: calls are fire-and-check, errors raise).
veRL's servers do not stream, so ``generate`` hands a chunk's tokens to ``on_tokens`` (and so to
the grouped draft server) when the chunk ends. ``import_drafts``, ``drafter_stats`` and ``refresh_progress`` (running requests'
tokens so far, for ``progress`` and ``partial``: the drafter's ``progress`` op) need the drafter's answer, which
``collective_rpc`` drops: they run the same RPC through the server's engine client inside the
server actor (Ray's ``__ray_call__``), and so does ``abort`` (veRL's ``abort_request`` misses vLLM
0.32's internal request ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Iterable, Optional

from verl_ext.engine.drafter_ops import DrafterOp, ImportGroups, Progress, RequestProgress, SetWindows, Stats
from verl_ext.engine.instance import KEYED_SEED, Completion, GenRequest, Instance, Telemetry, chunk_seed
from verl_ext.rollout.finish import finish_reason
from verl_ext.rollout.verl_compat import server_engine
from verl_ext.spec.options import REQUEST_DRAFT_KEYS
from verl_ext.vllm.machine import confirms_keyed_sampling

SAMPLING_KEY = "verl_sampling_params"
#: ``GenRequest.extra`` key: the length of the prompt veRL sent (a continuation's prompt also holds
#: the response tokens generated so far)
BASE_LEN_KEY = "verl_prompt_len"
KWARGS_KEY = "verl_generate_kwargs"
TOKEN_OUTPUT_KEY = "token_output"

logger = logging.getLogger(__name__)


class ReplicaInstance(Instance):
    def __init__(self, name: str, handle: Any, max_tokens_default: Optional[int] = None,
                 max_running: Optional[int] = None, drafting: bool = False, versions: Optional[dict] = None,
                 stop_ids: Iterable[int] = (), keyed_sampling: bool = False):
        """``max_running``: the server's ``max_num_seqs`` (veRL's rollout config), for strategies
        that keep each replica below the concurrency at which it would queue or preempt.
        ``drafting``: the server is vLLM with verl_ext's drafter (see the module docstring).
        ``keyed_sampling``: the server is a vLLM that verl_ext's plugin keys samples in
        (``verl_ext.vllm.keyed``).
        ``versions``: request id -> oldest weight version (``global_steps``) any of its outputs
        reported, shared by the dispatcher's instances (a request's chunks may span a weight sync).
        ``stop_ids``: the model's EOS ids (``verl_ext.rollout.finish``), which tell a response
        that ended on its last allowed token from one that was cut off there."""
        self.name = name
        self.stop_ids = frozenset(stop_ids)
        self.versions = versions
        self.drafting = drafting
        self.keyed_sampling = keyed_sampling
        self.engine_info: Optional[dict] = None  # ``engine_report``
        self.max_running = max_running
        self.handle = handle
        self.max_tokens_default = max_tokens_default
        self._engine_ids: dict[str, str] = {}
        self._inflight = 0
        self._generated = 0
        self._load: dict[str, float] = {}  # the server's last /metrics reading (parse_load)
        self._load_at: Optional[float] = None  # when it was read (time.monotonic)
        self._load_failures = 0
        # request id -> (tokens so far, engine steps, the tokens or None): refresh_progress
        self._progress: dict[str, RequestProgress] = {}
        self._progress_failures = 0

    def _sampling(self, request: GenRequest) -> dict:
        params = dict(request.extra.get(SAMPLING_KEY) or {})
        original = params.get("max_tokens", params.get("max_new_tokens", self.max_tokens_default))
        if original is None or request.sampling.max_tokens < original:
            params.pop("max_new_tokens", None)
            params["max_tokens"] = request.sampling.max_tokens
        keyed = request.sampling.keyed_seed if self.keyed_sampling else None
        chunk = int(request.extra.get("chunk", 0))
        if chunk and params.get("seed") is not None and keyed is None:  # chunks do not replay one random stream
            params["seed"] = chunk_seed(int(params["seed"]), chunk)
        done = len(request.prompt_ids) - int(request.extra.get(BASE_LEN_KEY, len(request.prompt_ids)))
        if params.get("min_tokens"):  # a continuation's tokens so far count; a chunk cannot ask for more than its budget
            left = max(0, int(params["min_tokens"]) - max(0, done))
            params["min_tokens"] = min(left, int(params.get("max_tokens", request.sampling.max_tokens)))
        if self.drafting or keyed is not None:
            extra_args = dict(params.get("extra_args") or {})
            extra_args["verl_ext"] = {"request_id": request.request_id, "group_id": request.group_id,
                                      "prompt_key": request.history_key,
                                      **{k: request.extra[k] for k in REQUEST_DRAFT_KEYS if k in request.extra},
                                      **({KEYED_SEED: keyed} if keyed is not None else {})}
            params["extra_args"] = extra_args
        return params

    async def set_spec_windows(self, windows: dict, modes: Optional[dict] = None) -> int:
        """New draft windows of running requests (the drafter's ``set_windows`` op, addressed by
        verl_ext's request id). vLLM speculates coupled only, so ``modes`` do not apply.
        ``collective_rpc`` returns nothing: the count is of the windows sent."""
        if not self.drafting or not windows:
            return 0
        await self.drafter_call(SetWindows({str(k): int(v) for k, v in windows.items()}))
        return len(windows)

    async def drafter_call(self, op: DrafterOp) -> None:
        """Run one drafter operation (``verl_ext.engine.drafter_ops``) on every worker of the
        server; its ``collective_rpc`` returns nothing."""
        if not self.drafting:
            raise RuntimeError(f"server {self.name} runs no verl_ext drafter")
        await self.handle.collective_rpc.remote("verl_ext_drafter", args=op.wire())

    async def engine_report(self, timeout_s: float = 30.0) -> Optional[dict]:
        """What the server's engine runs (its first worker's ``verl_ext_engine_info``: vLLM version,
        CPU ISA and kernel library, keyed sampling's state and rule), kept in ``engine_info``; None
        where it cannot answer (verl_ext's vLLM plugin not active in the server's processes, an
        older Ray). ``keyed_sampling`` becomes what the engine confirmed: a server that cannot say
        it keys samples is not trusted to (copies of sampled requests would race)."""
        try:
            answers = await self.handle.__ray_call__.remote(_engine_info_rpc, timeout_s)
            self.engine_info = answers[0] if answers else None
        except Exception as exc:
            logger.warning("verl_ext: server %s did not report what it runs (%s: %s)", self.name, type(exc).__name__, exc)
            self.engine_info = None
        self.keyed_sampling = self.keyed_sampling and confirms_keyed_sampling(self.engine_info)
        return self.engine_info

    async def drafter_stats(self, timeout_s: float = 10.0) -> Optional[dict]:
        """The drafter's ``stats`` (its first worker's answer). None without a drafter, or where the
        server cannot answer (an older Ray without ``__ray_call__``, an engine not started yet)."""
        if not self.drafting:
            return None
        try:
            answers = await self.handle.__ray_call__.remote(_drafter_rpc, Stats(), timeout_s)
        except Exception:
            return None
        return answers[0] if answers else None

    async def refresh_progress(self, request_ids=None, tokens: bool = False, timeout_s: float = 10.0) -> bool:
        """Read how many tokens running requests have so far and their engine steps from the
        drafter (its ``progress`` op), with ``tokens`` the tokens too (a reading without them is
        a few numbers per request); ``progress`` and ``partial`` answer from the last reading.
        False without a drafter or a running request; raises where the server does not answer
        (the last reading stays; the first failure is logged)."""
        ids = list(self._engine_ids) if request_ids is None else [str(r) for r in request_ids]
        if not self.drafting or not ids:
            return False
        asked = {rid: self._engine_ids.get(rid) for rid in ids}  # a reading is of the run it asked about
        try:
            answers = await self.handle.__ray_call__.remote(_drafter_rpc, Progress(ids, tokens), timeout_s)
        except Exception as exc:
            self._progress_failures += 1
            if self._progress_failures == 1:
                logger.warning("verl_ext: no progress reading from %s (%s: %s); strategies that rank running "
                               "requests by it see none this round", self.name, type(exc).__name__, exc)
            raise
        got: dict[str, RequestProgress] = {}
        for answer in answers or ():  # every worker runs every request (tensor parallel): the longest reading
            for rid, reading in answer.items():
                if rid in asked and (rid not in got or reading.tokens > got[rid].tokens):
                    got[rid] = reading
        got = {rid: v for rid, v in got.items() if self._engine_ids.get(rid) == asked[rid]}
        self._progress.update(got)
        return bool(got)

    def progress(self, request_id: str) -> Optional[tuple[int, int]]:
        got = self._progress.get(request_id)
        return None if got is None else (got.tokens, got.steps)

    def partial(self, request_id: str) -> Optional[list]:
        got = self._progress.get(request_id)
        return None if got is None or got.token_ids is None else list(got.token_ids)

    async def import_drafts(self, blobs: list, timeout_s: float = 30.0) -> list[int]:
        """Import grouped draft server deltas (``verl_ext.spec.dgds``) into the server's drafter,
        as ``VLLMInstance.import_drafts``: per blob, the tokens it added (0: nothing new) or -1
        where a worker refused it (the client then resends that group in full). The answer needs
        the drafter's return value, which ``collective_rpc`` drops: the RPC runs through the
        server's engine client (``__ray_call__``); errors raise (the client retries, then pauses
        pushing to this server)."""
        if not self.drafting:
            raise RuntimeError(f"server {self.name} runs no verl_ext drafter")
        answers = await self.handle.__ray_call__.remote(_drafter_rpc, ImportGroups(list(blobs)), timeout_s)
        # every worker holds its own drafter: a blob counts as imported only where all took it
        return [min(col) for col in zip(*answers)] if answers else [-1] * len(blobs)

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
            self._progress.pop(request.request_id, None)
        tokens = list(output.token_ids)
        self._generated += len(tokens)
        version = output.extra_fields.get("global_steps")
        if self.versions is not None and version is not None:
            rid = request.request_id
            self.versions[rid] = min(self.versions.get(rid, version), version)
        if on_tokens is not None and tokens:
            on_tokens(tokens)  # veRL's server does not stream: one delta at the end
        reason = finish_reason(tokens, output.stop_reason, request.extra.get(SAMPLING_KEY) or {},
                               request.sampling.max_tokens, self.stop_ids)
        return Completion(request.request_id, tokens, reason, logprobs=output.log_probs, extra={TOKEN_OUTPUT_KEY: output})

    async def abort(self, request_id: str, timeout_s: float = 10.0) -> None:
        """Abort a running request: its ``generate`` returns the tokens so far, stop reason
        "aborted". veRL 0.9.1's ``abort_request`` looks the id up among vLLM's internal request
        ids, which vLLM 0.32 derives from the id it was given, so it finds nothing; the abort
        goes to the server's engine client instead (``engine.abort`` maps the given id), and to
        ``abort_request`` where that cannot run."""
        engine_id = self._engine_ids.get(request_id)
        if engine_id is None:
            return
        try:
            await self.handle.__ray_call__.remote(_engine_abort, engine_id, timeout_s)
            return
        except Exception as exc:
            logger.debug("verl_ext: abort through %s's engine client failed (%s); using abort_request", self.name, exc)
        if hasattr(self.handle, "abort_request"):
            await self.handle.abort_request.remote(engine_id)

    async def refresh(self, timeout_s: float = 1.0) -> bool:
        """Read the server's load from its Prometheus page (``server_metrics.parse_load``);
        False, keeping the last reading, when it does not answer."""
        from verl_ext.rollout import server_metrics

        if ":" not in self.name:  # not a server address (veRL names its servers host:port)
            return False
        try:
            text = await asyncio.to_thread(server_metrics.fetch, self.name, timeout_s)
        except Exception:
            self._load_failures += 1
            return False
        self._load, self._load_at = server_metrics.parse_load(text), time.monotonic()
        return True

    def telemetry(self) -> Telemetry:
        """What the dispatcher sent here and has not got back (exact), split into running and
        waiting by the server's last reading; KV usage and capacity, engine steps, generated,
        drafted and accepted tokens from that reading (``refresh``; absent without one), which is
        also the snapshot's ``timestamp``."""
        load, inflight = self._load, self._inflight
        running = min(inflight, int(load["running"])) if "running" in load else inflight
        cap = load.get("kv_capacity_tokens")
        return Telemetry(
            running=running,
            waiting=inflight - running if "running" in load else None,
            kv_cache_usage=load.get("kv_cache_usage"),
            generated_tokens=int(load.get("generated_tokens", self._generated)),
            steps=int(load.get("steps", 0)),
            drafts=int(load.get("drafts", 0)),
            draft_tokens=int(load.get("draft_tokens", 0)),
            accepted_tokens=int(load.get("accepted_tokens", 0)),
            kv_capacity_tokens=None if cap is None else int(cap),
            max_running=self.max_running,
            **({"timestamp": self._load_at} if self._load_at is not None else {}),
        )


def _drafter_rpc(server, op: DrafterOp, timeout_s: float):
    """Runs inside a veRL ``vLLMHttpServer`` actor, on one of Ray's threads (``__ray_call__``): the
    drafter operation through the server's vLLM engine client on the actor's event loop (where
    its output handler runs); every worker's answer, as ``op.result`` gives it."""
    answers = _on_engine_loop(server_engine(server), lambda e: e.collective_rpc("verl_ext_drafter", args=op.wire()), timeout_s)
    return [op.result(a) for a in answers] if answers else answers


def _engine_info_rpc(server, timeout_s: float):
    """Runs inside a veRL ``vLLMHttpServer`` actor, like ``_drafter_rpc``: every worker's
    ``verl_ext_engine_info`` (``verl_ext.vllm.machine.engine_info``)."""
    return _on_engine_loop(server_engine(server), lambda e: e.collective_rpc("verl_ext_engine_info"), timeout_s)


def _engine_abort(server, request_id: str, timeout_s: float):
    """Runs inside a veRL ``vLLMHttpServer`` actor, like ``_drafter_rpc``: aborts the request the
    server's ``generate`` started with id ``request_id`` (vLLM maps it to its internal ids)."""
    return _on_engine_loop(server_engine(server), lambda e: e.abort(request_id), timeout_s)


def _on_engine_loop(engine, call, timeout_s: float):
    """``call(engine)``'s coroutine run on the loop of the vLLM engine client's output handler,
    from another thread; its result."""
    handler = getattr(engine, "output_handler", None)
    loop = handler.get_loop() if handler is not None else None
    if loop is None or loop.is_closed():
        raise RuntimeError("the server's engine client has no running event loop yet")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:  # on the loop's own thread, waiting below would deadlock it
        raise RuntimeError("cannot wait for the engine on the server's event loop thread")
    return asyncio.run_coroutine_threadsafe(call(engine), loop).result(timeout_s)
