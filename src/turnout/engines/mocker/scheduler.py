"""The mocker's scheduler: vLLM's continuous batching, without the model (sync, no asyncio).

Mental model (vLLM v1): there is no prefill phase and no decode phase, only computed tokens
catching up with known tokens. Each request has ``token_ids`` (prompt + output so far) and
``num_computed`` of them in the KV cache. A step gives each scheduled request
``min(len(token_ids) - num_computed, budget)`` tokens: a long prompt catches up over several
steps (chunked prefill), a decoding request needs exactly one. When a request catches up, the
"model" samples one token, which makes it one behind again.

One step:

1. Running requests first, in arrival order. Each needs blocks for its new tokens; when the
   pool runs dry, the *last* running request is preempted (recompute style: its blocks go
   back, cached ones stay matchable, and it rejoins the front of the waiting queue) until
   the allocation fits or the request itself was the one preempted.
2. Then, if nobody was preempted, waiting requests in order, while the token budget,
   ``max_num_seqs`` and the pool allow. A fresh request first looks up its prefix in the
   pool: resident blocks are shared, only the rest is computed (``cached_tokens``).
3. The step's duration comes from the timing model, then every scheduled request advances:
   full blocks are committed under their hashes (KV events), tokens are sampled, stop rules
   applied, finished requests freed.

Disaggregated serving adds two twists: a prefill-stage request (``hold_kv``) that ends at its
token limit *parks* its blocks under its id instead of freeing them, until
``release_parked`` (the decode side has them, or nobody will take them); a decode-stage
request (``imported_tokens``) stores the KV it received at admission, as blocks of its own,
and computes only the rest.

Back-pressure adds a third: a request whose reader fell behind is *paused* (``pause``, by
the engine, when its stream holds too many undelivered outputs) and *resumed* once the reader
caught up. vLLM has no such state: a request decodes to its end whether or not its client
reads (v1's per-request ``RequestOutputCollector`` merges the unread deltas into one growing
output). The mocker pauses instead, so a stalled client costs neither steps nor memory that
grows with its output. A paused request:

* keeps its place and its blocks, but is scheduled for nothing: no prefill chunk, no decode
  token, no share of the token budget, not timed into the step;
* still counts in ``num_running`` (it holds a batch slot and KV, as a load report should say);
* is the first victim when blocks run out, and is preempted (recompute style) to make room
  when a waiting request finds every slot, or the pool, taken: a stalled client never blocks
  the others. A paused request in the waiting queue is passed over, not admitted;
* when every request is paused, ``has_work`` is false: the engine's loop parks until a
  resume (or a new request) wakes it.

Expected failures are values: a request that can never fit is refused at ``add_request``
with an ERROR output; a request that outgrows the whole pool ends with ``LENGTH``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from turnout.engines.mocker.config import MockerConfig
from turnout.engines.mocker.kv_pool import KvBlockPool
from turnout.engines.mocker.request import MockRequest, RequestState
from turnout.engines.mocker.timing import PolynomialTimingModel, TimingModel, step_ms
from turnout.engines.mocker.tokens import HashTokenSampler, TokenSampler, token_seed
from turnout.protocols.block_hashing import (
    compute_block_hashes,
    compute_local_block_hashes,
    compute_sequence_hashes,
)
from turnout.protocols.llm import (
    CompletionUsage,
    ErrorKind,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
)

#: (request id, output): what a step produced for one request.
StepOutput = tuple[str, LLMEngineOutput]
#: ``Scheduler.on_block_stored``: (sequence hash, the block's token ids, cache salt).
BlockStoredHook = Callable[[int, list[int], str | None], None]

#: ``_admit``: the pool cannot hold the request's blocks now (as opposed to 0: it does not
#: start this step for lack of token budget).
_NO_BLOCKS = -1


@dataclass(slots=True)
class StepResult:
    """What one step did. ``duration_s`` is simulated GPU time, before any speedup."""

    duration_s: float = 0.0
    outputs: list[StepOutput] = field(default_factory=list)
    num_scheduled: int = 0
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    num_preempted: int = 0
    #: KV cache utilisation the step was timed at.
    kv_usage: float = 0.0


@dataclass(slots=True, frozen=True)
class SchedulerLoad:
    """The numbers a load report carries, read without scanning."""

    active_prefill_tokens: int
    active_decode_blocks: int
    kv_usage: float
    num_waiting: int
    num_running: int
    total_kv_blocks: int


class Scheduler:
    """Waiting and running queues over one ``KvBlockPool``; call ``step`` in a loop."""

    def __init__(
        self,
        config: MockerConfig,
        *,
        pool: KvBlockPool | None = None,
        timing: TimingModel | None = None,
        sampler: TokenSampler | None = None,
    ) -> None:
        self._config = config
        self._vocab_size = config.vocab_size
        self._block_size = config.block_size
        self._caching = config.enable_prefix_caching
        self._chunked = config.enable_chunked_prefill
        self._max_context = config.max_context_tokens
        self.pool = pool or KvBlockPool(config.num_gpu_blocks, config.block_size)
        self._timing: TimingModel = timing or PolynomialTimingModel()
        self._sampler: TokenSampler = sampler or HashTokenSampler(config.vocab_size)
        self._default_eos = frozenset(config.eos_token_ids)
        self._waiting: deque[MockRequest] = deque()
        self._running: list[MockRequest] = []
        self._requests: dict[str, MockRequest] = {}
        #: Prefill-stage requests' blocks kept for a decode worker: id -> (hashes, private).
        self._parked: dict[str, tuple[list[int], int]] = {}
        # Sum of pending_prefill_tokens over unfinished requests, moved at each change.
        self._pending_prefill = 0
        # Unfinished requests with ``paused`` set, moved by pause / resume / _finish.
        self._num_paused = 0
        #: Preemptions since start (a counter for tests and metrics).
        self.num_preemptions = 0
        #: Told the tokens of every block about to become resident, before its
        #: ``BlockStored`` is buffered: ``(seq_hash, token_ids, cache_salt)``. For a publisher
        #: of an engine's own events, which carry token ids (turnout's carry hashes only).
        self.on_block_stored: BlockStoredHook | None = None

    # ---- intake ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        request: PreprocessedRequest,
        *,
        hold_kv: bool = False,
        imported_tokens: int = 0,
    ) -> LLMEngineOutput | None:
        """Queue a request. Returns the final ERROR output instead when it can never run.

        ``hold_kv``: park the blocks when the request ends at its token limit (a prefill
        stage). ``imported_tokens``: leading tokens whose KV arrived from elsewhere.
        """
        if request_id in self._requests:
            return _error(f"request id {request_id!r} is already in this engine", 0)
        prompt = request.token_ids
        n = len(prompt)
        if len(self._waiting) >= self._config.max_waiting:
            return _error(
                f"{len(self._waiting)} requests are waiting (max_waiting="
                f"{self._config.max_waiting}); try again later",
                n,
                ErrorKind.OVERLOADED,
            )
        stop = request.stop_conditions
        error = None
        if n == 0:
            error = "the prompt is empty"
        elif n > self._max_context:
            error = (
                f"the prompt has {n} tokens, more than this worker's whole KV cache holds "
                f"({self._config.num_gpu_blocks} blocks x {self._block_size} tokens = "
                f"{self._max_context})"
            )
        elif not self._chunked and n > self._config.max_num_batched_tokens:
            error = (
                f"the prompt has {n} tokens, more than max_num_batched_tokens="
                f"{self._config.max_num_batched_tokens}, and chunked prefill is off"
            )
        elif stop.max_tokens is not None and stop.max_tokens < 1:
            error = f"max_tokens must be at least 1, got {stop.max_tokens}"
        if error is not None:
            return _error(error, n, ErrorKind.BAD_REQUEST)

        eos = frozenset(request.eos_token_ids) if request.eos_token_ids else self._default_eos
        req = MockRequest(
            request_id=request_id,
            token_ids=list(prompt),
            prompt_len=n,
            max_tokens=stop.max_tokens or self._config.default_max_tokens,
            min_tokens=stop.min_tokens or 0,
            ignore_eos=stop.ignore_eos,
            eos_at_end=stop.max_tokens is None,
            eos_token_ids=eos,
            stop_token_ids=frozenset(stop.stop_token_ids_hidden or ()),
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            token_seed=token_seed(self._config.seed, prompt, request.original_prompt_len),
            hold_kv=hold_kv,
            imported_tokens=min(max(imported_tokens, 0), n),
            want_logprobs=request.output_options.logprobs is not None,
            want_top=request.output_options.logprobs or 0,
        )
        if self._caching:
            local, seq = compute_block_hashes(
                prompt, self._block_size, lora_name=req.lora_name, cache_salt=req.cache_salt
            )
            req.local_hashes = list(local)
            req.seq_hashes = list(seq)
        self._requests[request_id] = req
        self._waiting.append(req)
        self._pending_prefill += n
        return None

    def release_parked(self, request_id: str) -> int:
        """Free the blocks a prefill-stage request parked; how many (0: none parked)."""
        parked = self._parked.pop(request_id, None)
        if parked is None:
            return 0
        hashes, private = parked
        self.pool.free(hashes, private)
        return len(hashes) + private

    def is_parked(self, request_id: str) -> bool:
        return request_id in self._parked

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def pause(self, request_id: str) -> bool:
        """Schedule nothing more for ``request_id`` until ``resume``: its reader fell behind.
        Its blocks stay held (see the module docstring for what else a pause means). False
        when it is not here (finished, aborted) or already paused."""
        req = self._requests.get(request_id)
        if req is None or req.paused:
            return False
        req.paused = True
        self._num_paused += 1
        return True

    def resume(self, request_id: str) -> bool:
        """Schedule ``request_id`` again, from where it stopped. False when it is not here or
        not paused."""
        req = self._requests.get(request_id)
        if req is None or not req.paused:
            return False
        req.paused = False
        self._num_paused -= 1
        return True

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone): free its blocks. False when it is not here."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if req.state is RequestState.WAITING:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
        req.finish_reason = FinishReason.CANCELLED
        self._finish(req)
        return True

    # ---- views ----------------------------------------------------------------------------

    @property
    def is_full(self) -> bool:
        """The waiting queue is at its bound: new requests are refused as overloaded."""
        return len(self._waiting) >= self._config.max_waiting

    def has_work(self) -> bool:
        """Whether a step could do anything: some request is waiting or running unpaused."""
        return len(self._running) + len(self._waiting) > self._num_paused

    @property
    def num_paused(self) -> int:
        """Unfinished requests that are paused (running or waiting)."""
        return self._num_paused

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get_request(self, request_id: str) -> MockRequest | None:
        return self._requests.get(request_id)

    def iter_request_ids(self) -> Iterator[str]:
        return iter(self._requests)

    def get_load(self) -> SchedulerLoad:
        pool = self.pool
        return SchedulerLoad(
            active_prefill_tokens=self._pending_prefill,
            active_decode_blocks=pool.num_used,
            kv_usage=pool.usage,
            num_waiting=len(self._waiting),
            num_running=len(self._running),
            total_kv_blocks=pool.capacity,
        )

    # ---- the step -------------------------------------------------------------------------

    def step(self, now: float = 0.0) -> StepResult:
        """Run one engine step starting at simulated time ``now`` (seconds)."""
        result = StepResult()
        budget = self._config.max_num_batched_tokens
        scheduled: list[tuple[MockRequest, int]] = []
        prefill_tokens = 0
        num_decodes = 0
        decode_context = 0

        # 1. Running requests, oldest first, paused ones passed over; when the pool runs dry,
        #    preempt a paused one, else the newest.
        running = self._running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.paused:
                i += 1
                continue
            remaining = len(req.token_ids) - req.num_computed
            n = min(remaining, budget)
            preempted_self = False
            while not self._ensure_blocks(req, req.num_computed + n):
                j = self._victim_index()
                victim = running.pop(j)
                self._preempt(victim)
                result.num_preempted += 1
                if victim is req:
                    preempted_self = True
                    break
                if j < i:
                    i -= 1  # a paused request before this one left the list
            if preempted_self:
                break
            scheduled.append((req, n))
            budget -= n
            if remaining == 1 and req.num_output > 0:
                num_decodes += 1
                decode_context += len(req.token_ids)
            else:
                prefill_tokens += n
            i += 1

        # 2. Waiting requests in order, paused ones passed over, when nothing was preempted
        #    this step. A request that finds no slot or no room preempts a paused one.
        if result.num_preempted == 0:
            max_seqs = self._config.max_num_seqs
            full_budget = self._config.max_num_batched_tokens
            waiting = self._waiting
            j = 0
            while j < len(waiting) and budget > 0:
                req = waiting[j]
                if req.paused:
                    j += 1
                    continue
                n = _NO_BLOCKS
                if len(running) < max_seqs:
                    n = self._admit(req, budget, budget == full_budget)
                if n == _NO_BLOCKS and self._preempt_paused():
                    result.num_preempted += 1
                    j += 1  # the victim went to the front of the queue, before ``req``
                    continue
                if n <= 0:
                    break
                del waiting[j]
                req.move_to(RequestState.RUNNING)
                running.append(req)
                scheduled.append((req, n))
                budget -= n
                prefill_tokens += n

        # 3. Time the step, then advance every scheduled request.
        result.num_scheduled = len(scheduled)
        result.num_prefill_tokens = prefill_tokens
        result.num_decodes = num_decodes
        # The decode pass reads the whole context of every decoding request (a shared prefix
        # once per request), over the pool's token capacity: Dynamo's mocker measures it so.
        result.kv_usage = usage = min(decode_context / self._max_context, 1.0)
        result.duration_s = step_ms(self._timing, prefill_tokens, num_decodes, usage) / 1000.0
        end = now + result.duration_s
        outputs = result.outputs
        for req, n in scheduled:
            out = self._advance(req, n, end)
            if out is not None:
                outputs.append((req.request_id, out))
        return result

    # ---- internals ------------------------------------------------------------------------

    def _admit(self, req: MockRequest, budget: int, batch_empty: bool) -> int:
        """Take the prefix hit and blocks for a waiting request; the tokens to compute now,
        0 when the budget does not let it start this step, ``_NO_BLOCKS`` when the pool
        cannot hold it (nothing changed in either case)."""
        bs = self._block_size
        total = len(req.token_ids)
        hit = 0
        if self._caching:
            # Always compute at least the last token: the model must run to sample.
            hit = self.pool.num_cached_prefix(req.seq_hashes[: (total - 1) // bs])
        cached = hit * bs
        # KV received from a prefill worker counts as computed (the last token still runs).
        start = max(cached, min(req.imported_tokens, total - 1))
        remaining = total - start
        n = min(remaining, budget)
        if not self._chunked and n < remaining:
            if not batch_empty:
                return 0
            n = remaining  # alone in the step it may exceed the budget rather than starve
        if hit:
            self.pool.acquire_cached(req.seq_hashes[:hit])
        need = -(-(start + n) // bs) - hit
        if not self.pool.allocate(need):
            if hit:
                self.pool.free(req.seq_hashes[:hit])
            return _NO_BLOCKS
        req.held_hashes = req.seq_hashes[:hit]
        req.num_private = need
        self._set_computed(req, start)
        if self._caching and start // bs > hit:
            self._commit_full_blocks(req)  # the received blocks: stored, as computed ones are
        # Once only: after a preemption the request recomputes, as vLLM's would.
        req.imported_tokens = 0
        if req.cached_tokens is None:
            req.cached_tokens = min(cached, req.prompt_len)
        return n

    def _ensure_blocks(self, req: MockRequest, num_tokens: int) -> bool:
        need = -(-num_tokens // self._block_size) - req.num_blocks_held
        if need <= 0:
            return True
        if not self.pool.allocate(need):
            return False
        req.num_private += need
        return True

    def _victim_index(self) -> int:
        """Where in ``_running`` the next preemption victim is: the newest paused request
        (its reader is not reading, so it loses nothing it would use soon), else the newest."""
        j = self._last_paused_index()
        return j if j >= 0 else len(self._running) - 1

    def _preempt_paused(self) -> bool:
        """Preempt the newest paused running request; False when none runs."""
        j = self._last_paused_index()
        if j < 0:
            return False
        self._preempt(self._running.pop(j))
        return True

    def _last_paused_index(self) -> int:
        """Index in ``_running`` of the newest paused request; -1 when none (no scan when
        nothing is paused: the hot path)."""
        running = self._running
        if self._num_paused:
            for j in range(len(running) - 1, -1, -1):
                if running[j].paused:
                    return j
        return -1

    def _preempt(self, req: MockRequest) -> None:
        self.pool.free(req.held_hashes, req.num_private)
        req.held_hashes = []
        req.num_private = 0
        self._set_computed(req, 0)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.move_to(RequestState.WAITING)
        self._waiting.appendleft(req)

    def _set_computed(self, req: MockRequest, num_computed: int) -> None:
        before = req.pending_prefill_tokens
        req.num_computed = num_computed
        self._pending_prefill += req.pending_prefill_tokens - before

    def _advance(self, req: MockRequest, n: int, end: float) -> LLMEngineOutput | None:
        """Apply ``n`` computed tokens; sample and check stops when the request caught up."""
        computed = req.num_computed + n
        if req.num_computed < req.prompt_len:
            self._set_computed(req, computed)  # moves the pending-prefill counter
        else:
            req.num_computed = computed  # decode: the counter does not move (hot path)
        if self._caching and computed // self._block_size > len(req.held_hashes):
            self._commit_full_blocks(req)
        if req.num_computed < len(req.token_ids):
            return None  # mid-prefill: nothing to emit yet

        token = self._sampler.next_token(req)
        req.token_ids.append(token)
        req.num_output += 1
        if req.first_token_time is None:
            req.first_token_time = end
        if self._caching and len(req.token_ids) % self._block_size == 0:
            self._extend_hashes(req)

        reason: FinishReason | None = None
        if req.num_output >= req.min_tokens:
            if token in req.stop_token_ids:
                reason = FinishReason.STOP
            elif token in req.eos_token_ids and not req.ignore_eos:
                reason = FinishReason.EOS
        if reason is None and (
            req.num_output >= req.max_tokens or len(req.token_ids) >= self._max_context
        ):
            reason = FinishReason.LENGTH
        logprobs = tops = None
        if req.want_logprobs:
            logprob = simulated_logprob(req, token)
            logprobs = [logprob]
            if req.want_top:
                tops = [simulated_alternatives(token, logprob, req.want_top, self._vocab_size)]
        if reason is None:
            return LLMEngineOutput(token_ids=[token], log_probs=logprobs, top_logprobs=tops)
        req.finish_reason = reason
        self._running.remove(req)
        if req.hold_kv and reason is FinishReason.LENGTH:
            self._park(req)
        else:
            self._finish(req)
        return LLMEngineOutput(
            token_ids=[token],
            log_probs=logprobs,
            top_logprobs=tops,
            finish_reason=reason,
            usage=CompletionUsage(
                prompt_tokens=req.prompt_len,
                completion_tokens=req.num_output,
                cached_tokens=req.cached_tokens or 0,
            ),
        )

    def _commit_full_blocks(self, req: MockRequest) -> None:
        full = req.num_computed // self._block_size
        held = req.held_hashes
        pool = self.pool
        hook = self.on_block_stored
        bs = self._block_size
        while len(held) < full:
            i = len(held)
            h = req.seq_hashes[i]
            if hook is not None and not pool.is_resident(h):
                hook(h, req.token_ids[i * bs : (i + 1) * bs], req.cache_salt)
            pool.commit(
                h,
                req.local_hashes[i],
                req.seq_hashes[i - 1] if i else None,
                lora_name=req.lora_name,
            )
            held.append(h)
            req.num_private -= 1

    def _extend_hashes(self, req: MockRequest) -> None:
        """Hash the block that the last sampled token completed."""
        bs = self._block_size
        start = len(req.token_ids) - bs
        (local,) = compute_local_block_hashes(
            req.token_ids[start:], bs, lora_name=req.lora_name, cache_salt=req.cache_salt
        )
        parent = req.seq_hashes[-1] if req.seq_hashes else None
        (seq,) = compute_sequence_hashes([local], parent)
        req.local_hashes.append(local)
        req.seq_hashes.append(seq)

    def _park(self, req: MockRequest) -> None:
        """Keep a finished prefill-stage request's blocks for its decode worker."""
        self._parked[req.request_id] = (req.held_hashes, req.num_private)
        req.held_hashes = []
        req.num_private = 0
        self._finish(req)

    def _finish(self, req: MockRequest) -> None:
        """Free a request that left both queues."""
        self.pool.free(req.held_hashes, req.num_private)
        req.held_hashes = []
        req.num_private = 0
        self._pending_prefill -= req.pending_prefill_tokens
        if req.paused:
            req.paused = False
            self._num_paused -= 1
        req.move_to(RequestState.FINISHED)
        del self._requests[req.request_id]


def simulated_logprob(req: MockRequest, token: int) -> float:
    """A token's log probability, simulated: deterministic in (request seed, position, token),
    in [-4, 0), so clients and tests see stable, plausible numbers."""
    mixed = (token * 0x9E3779B1 + len(req.token_ids) * 0x85EBCA77 + req.token_seed) & 0xFFFFFFFF
    return -((mixed % 4000) + 1) / 1000.0


def simulated_alternatives(
    token: int, logprob: float, k: int, vocab_size: int
) -> list[tuple[int, float]]:
    """``k`` alternatives for a token sampled with ``logprob``, most likely first: the token
    itself and ``k - 1`` others (deterministic in the token), sharing the rest of the
    probability by halves, so the whole is a valid distribution."""
    rest = max(1.0 - math.exp(logprob), 1e-9)
    alts = [(token, logprob)]
    for i in range(1, min(k, vocab_size)):
        other = (token + i * 7919) % vocab_size
        alts.append((other, math.log(rest) - i * math.log(2.0)))
    alts.sort(key=lambda a: -a[1])
    return alts


def _error(message: str, prompt_tokens: int, kind: ErrorKind | None = None) -> LLMEngineOutput:
    return LLMEngineOutput(
        finish_reason=FinishReason.ERROR,
        error=message,
        error_kind=kind.value if kind is not None else None,
        usage=CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=0, cached_tokens=0),
    )
