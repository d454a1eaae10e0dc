"""Speculative decoding on the driver: the configuration (vLLM's `speculative_config` dict) and the proposers.

    step N:  propose()  ──► req.spec_token_ids = d drafts (d <= k) for each running decode request
             schedule() ──► the request runs 1 + d tokens (its last token and the drafts), KV slots reserved for all
             runner     ──► scores the 1 + d positions, keeps the drafts the target agrees with (workers/spec_verify.py)
                            and one token of its own: 1 to d + 1 tokens a step
             update_from_output() ──► appends them; the rejected drafts' KV slots are given back (BlockManager.shrink)

Two kinds of proposer plug in here. A `Proposer` sees one sequence's token ids on the driver: the n-gram proposer
(prompt lookup) finds the latest earlier occurrence of the sequence's last n tokens (n from prompt_lookup_max down
to prompt_lookup_min) and proposes the up to k tokens that followed it. A `BatchProposer` sees the step's speculating
requests at once: the draft-model proposer asks the executor (`Executor.propose_drafts`), whose workers run a smaller
model with the target's vocabulary (workers/draft_runner.py: it catches up on the tokens it has not seen, then k
steps, greedy for a greedy request, drawn from its softmax at the request's temperature for a sampled one). The
n-gram proposer's drafts are one-hot draft distributions; the draft model's sampled drafts come with theirs, which
stay on the workers for the verification (kernels/rejection_sampler.py takes either). An EAGLE head would be a
BatchProposer whose workers also read the target's hidden states and keep their draft distributions the same way:
not built.

A proposer that fails proposes nothing: the step runs without drafts, and no request fails for it.

The n-gram proposer also runs on the workers (kernels/ngram.py, over their device token histories): when the
engine launches a step before the one in flight is read back, `propose(..., on_device=True)` gives each request
DEVICE_DRAFT placeholders instead, as many as its room, and the workers fill them with the same lookup's drafts,
after the tokens of the step in flight (docs/architecture.md, steps launched ahead of a verify step). Every request
runs ahead: a seed's noise keys and min_tokens' count of outputs move back on the device by the drafts the step in
flight rejected, penalties read the device histories, and a grammar's step defers its sampling until the driver has
read the step before and advanced the grammar: the workers send it the drafts they proposed, and its bitmask has a
row for each position the grammar reaches through them (Executor.awaiting; engine/llm_engine.py).

A request with a grammar speculates within it: its drafts are cut to the longest prefix its grammar accepts
(`RequestGrammar.valid_prefix`), and the step's bitmask has a row for each of its positions (the grammar's state
after each prefix of the drafts), which the verification applies as the plain sampler applies one; device drafts are
cut the same way once the driver has them, where their mask rejects the first the grammar would not take. Requests
still in prefill (or whose grammar is compiling) are not speculated; a step with drafts from the driver runs without
overlap (its drafts need the previous step's accepted tokens on the host), pipelined: engine/llm_engine.py makes the
previous step's deltas while it runs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from engine import envs
from engine.config import SpeculativeConfig
from engine.outputs import DEVICE_DRAFT, DraftAsk

if TYPE_CHECKING:
    from engine.executor import Executor
    from engine.request import Request

logger = logging.getLogger(__name__)

class Proposer(Protocol):
    def propose(self, token_ids: np.ndarray) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (the sequence's known tokens, int64), possibly none."""
        ...


class BatchProposer(Protocol):
    def propose_batch(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        """Up to max_drafts[i] draft tokens for each request (decode requests: every known token but the last is in
        the KV cache), possibly none."""
        ...


@dataclass
class DraftModelProposer:
    """A draft model on the workers: one executor call a step for every speculating request. A failed call (a
    worker's draft forward raised) gives no drafts; the worker drops its draft state and catches up next time."""

    executor: Executor

    def propose_batch(self, requests: list[Request], max_drafts: list[int]) -> list[list[int]]:
        ask = DraftAsk({r.req_id: r.num_tokens for r in requests},
                       {r.req_id: n for r, n in zip(requests, max_drafts)})
        try:
            drafts = self.executor.propose_drafts(ask)
        except Exception:  # noqa: BLE001 - a draft that fails fails no request: the step runs without drafts
            logger.exception("the draft model failed: this step runs without drafts")
            return [[] for _ in requests]
        return [list(drafts.get(r.req_id, ()))[:n] for r, n in zip(requests, max_drafts)]


@dataclass
class NgramProposer:
    """Prompt lookup: the longest match of the sequence's last n tokens (max_n down to min_n) earlier in it, its
    latest occurrence, gives the up to k tokens after it. Sequences of up to BYTES_MAX_TOKENS tokens are searched as
    bytes (`bytes.rfind` on their int32 values, a match counted only at a token boundary): 3-5 us a sequence on a
    2-core CPU where the numpy search below took 10-20 (its ten or so numpy calls), a host-bound verify step's
    largest part (SmolLM2 at batch 32 on the H200: 0.77 ms of its 5.8); longer ones by numpy, vectorized over the
    sequence: the positions that hold the last token, narrowed one earlier token at a time."""

    num_speculative_tokens: int
    min_n: int
    max_n: int

    BYTES_MAX_TOKENS = 4096  # past this, a byte search whose short pattern matches often (zero bytes) is slower

    def propose(self, token_ids: np.ndarray) -> list[int]:
        length = len(token_ids)
        longest, shortest = min(self.max_n, length - 1), max(self.min_n, 1)
        if longest < shortest:
            return []
        if length <= self.BYTES_MAX_TOKENS:
            end = _latest_match_bytes(token_ids, longest, shortest)
        else:
            end = _latest_match_numpy(token_ids, longest, shortest)
        if end < 0:
            return []
        return token_ids[end + 1:end + 1 + self.num_speculative_tokens].tolist()


def _latest_match_bytes(token_ids: np.ndarray, longest: int, shortest: int) -> int:
    """The last position of the latest earlier occurrence of the longest suffix of `longest` down to `shortest`
    tokens (one that ends before the last token), or -1."""
    data = token_ids.astype(np.int32).tobytes()
    limit = len(data) - 4  # an occurrence lies in the bytes before the last token's
    for n in range(longest, shortest - 1, -1):
        pattern = data[-4 * n:]
        stop = limit
        while (start := data.rfind(pattern, 0, stop)) >= 0:
            if start % 4 == 0:
                return start // 4 + n - 1
            stop = start + 4 * n - 1  # inside a token: the next occurrence starts before it
    return -1


def _latest_match_numpy(token_ids: np.ndarray, longest: int, shortest: int) -> int:
    """`_latest_match_bytes`, vectorized over the sequence with numpy."""
    length = len(token_ids)
    ends = np.flatnonzero(token_ids[:length - 1] == token_ids[length - 1])  # matches of 1 token, ending there
    best_n, best_end = (1, int(ends[-1])) if ends.size else (0, -1)
    for j in range(1, longest):  # keep the ends whose match goes on to j + 1 tokens
        ends = ends[ends >= j]
        ends = ends[token_ids[ends - j] == token_ids[length - 1 - j]]
        if not ends.size:
            break
        best_n, best_end = j + 1, int(ends[-1])
    return best_end if best_n >= shortest else -1


class TokenArrays:
    """Each speculating request's token ids as a numpy array for the n-gram lookup, extended each step by the tokens
    added since (converting the whole list every step would cost time in proportion to the context)."""

    def __init__(self) -> None:
        self.arrays: dict[str, tuple[Request, np.ndarray, int]] = {}  # req_id -> (request, buffer, tokens in it)

    def get(self, req: Request) -> np.ndarray:
        num_tokens, prompt = req.num_tokens, req.num_prompt_tokens
        req_id = req.req_id
        entry = self.arrays.get(req_id)
        if entry is not None and entry[0] is req and entry[2] <= num_tokens:
            _, buf, count = entry
        else:  # new (or its output was cut: stop strings): from scratch
            buf, count = np.empty(max(64, 2 * num_tokens), dtype=np.int64), 0
        if num_tokens > len(buf):
            buf = np.concatenate([buf[:count], np.empty(2 * num_tokens - count, dtype=np.int64)])
        if count < prompt:
            buf[count:prompt] = req.prompt_token_ids[count:]
            count = prompt
        buf[count:num_tokens] = req.output_token_ids[count - prompt:]
        self.arrays[req_id] = (req, buf, num_tokens)
        return buf[:num_tokens]

    def keep_only(self, req_ids: set[str]) -> None:
        for req_id in [r for r in self.arrays if r not in req_ids]:
            del self.arrays[req_id]


@dataclass
class SpecDecodeStats:
    """Counters with vLLM's meaning: drafts scored, drafts accepted, and accepted drafts by position (index j: the
    j-th draft of a step accepted)."""

    num_drafts: int = 0  # steps of a request that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class StepCostModel:
    """A step's time against the tokens it computes, t(n) = fixed + n * per_token (the weights' read, then compute),
    fitted by least squares over the engine's last `window` decode steps (each from its launch, or overlapped, from
    the read-back of the step before, to its read-back; a step with prompt chunks runs eagerly and is left out: on
    the H100 SmolLM2's 288-token one took 18 ms against 2.5 for a graphed 160-token verify step, and its slope priced
    verify steps out at batch 32). `ratio(n, m, extra_s)` =
    (t(m) + extra_s) / t(n): what a verify step of m tokens (and extra_s of the proposer's before it) costs against
    a plain one of n; None until the samples span enough token counts to fit both terms, and for m past the line's
    range (below). The fit is made again every REFIT_EVERY samples, not each step (over 256 samples it cost 0.16 ms
    of the host's step on a 2-core CPU, where SmolLM2's verify step at batch 32 takes 2.5 ms on an H200).

    The line is trusted up to EXTRAPOLATE times the largest step it was fitted on, no further (None past that):
    fitted on plain decode steps alone (speculation off, the prefills out of the window), its slope is what one
    more request costs, which on a host-bound model (SmolLM2 on an H200: the driver's and the runner's work a
    request) is mostly host time that a verify step pays once a request, not once a token; extrapolated to a verify
    step's 5x tokens it priced speculation out for good (the probes' few drafts never moved it). Unpriced, the engine
    speculates, and its verify steps' own times decide from then on."""

    REFIT_EVERY = 16
    EXTRAPOLATE = 2.0

    window: int = 256
    samples: deque = field(default_factory=deque)
    _fitted: tuple[float, float] | None = field(default=None, init=False, repr=False)
    _largest: int = field(default=0, init=False, repr=False)  # tokens of the largest step in the fit
    _since_fit: int = field(default=REFIT_EVERY, init=False, repr=False)  # samples since the fit (stale at first)

    def record(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))
        if len(self.samples) > self.window:
            self.samples.popleft()
        self._since_fit += 1

    def clear(self) -> None:
        self.samples.clear()
        self._since_fit = self.REFIT_EVERY

    def fit(self) -> tuple[float, float] | None:
        if self._since_fit >= self.REFIT_EVERY:
            self._fitted, self._since_fit = self._fit(), 0
        return self._fitted

    def _fit(self) -> tuple[float, float] | None:
        if len(self.samples) < 8:
            return None
        n, t = np.asarray(self.samples, dtype=np.float64).T
        self._largest = int(n.max())
        if n.max() < 2 * n.min():  # one size of step: the per-token term cannot be told from the fixed one
            return None
        per_token, fixed = np.polyfit(n, t, 1)
        per_token = max(float(per_token), 0.0)
        fixed = max(float(fixed), float(np.min(t - per_token * n)), 1e-9)
        return fixed, per_token

    def ratio(self, num_tokens: int, spec_tokens: int, extra_s: float = 0.0) -> float | None:
        fitted = self.fit()
        if fitted is None or spec_tokens > self.EXTRAPOLATE * self._largest:
            return None
        fixed, per_token = fitted
        return (fixed + spec_tokens * per_token + extra_s) / (fixed + num_tokens * per_token)


class RunAheadChoice:
    """Whether verify steps are launched ahead of the one in flight (device drafts, fixed up on the device) or
    pipelined (drafts from the driver, each verify step read back before the next launch), by measurement: each
    way's period between the read-backs of consecutive verify steps, a decaying average (in seconds: the two ways'
    samples are close in time, so of about the same batch). Ahead hides the host's step under the device's; its
    fix-ups and lookup cost the host more small launches, which a host-bound step (a small model: SmolLM2 on an
    H200, 3.5 against 1.3 ms a verify step) pays in full. The cheaper way runs; the other gets TRIAL_STEPS every
    `probe_every` verify steps, so the choice follows the batch: PROBE_EVERY at first, doubled by each trial that
    finds the other way slower still (up to PROBE_EVERY_MAX), back to PROBE_EVERY when a trial wins or the cheaper
    way turns the slower by its own steps (a trial in the slower way costs its steps' excess: at 6 of every 70 steps
    and a way 2x as dear, 8% of the run; a workload of short requests meets the trials again and again). The first
    step after a switch is not counted (it straddles both). Periods are timed only between consecutive verify steps,
    so a way that makes speculation stop paying would never be left (its verify steps, now only probes, are never
    consecutive): `drafts_off` leaves ahead for the pipelined way then, unless that was measured the slower.
    """

    TRIAL_STEPS = 6
    PROBE_EVERY = 64
    PROBE_EVERY_MAX = 1024
    DECAY = 0.7

    def __init__(self, pinned: bool | None = None) -> None:
        self.pinned = pinned  # PAGODA_SPEC_RUN_AHEAD=1 / 0: always / never ahead, nothing measured
        self.ahead = pinned is not False
        self.period: dict[bool, float | None] = {True: None, False: None}
        self.num_switches = 0
        self.probe_every = self.PROBE_EVERY  # the cheaper way's verify steps between trials of the other
        self._steps = 0  # verify steps read back since the last switch
        self._trial = False  # this way runs as a trial: the other was measured the cheaper

    def record(self, ahead: bool, period: float) -> bool:
        """A verify step read back: whether it was launched ahead, and its period. Returns whether the way switched."""
        if self.pinned is not None or ahead != self.ahead:  # (pinned: nothing to choose; else launched before a switch)
            return False
        self._steps += 1
        if self._steps == 1:
            return False
        old = self.period[ahead]
        mine = self.period[ahead] = period if old is None else self.DECAY * old + (1 - self.DECAY) * period
        other = self.period[not ahead]
        if other is None or mine > other:  # this way's trial (or it is the slower): back when done
            if self._steps > self.TRIAL_STEPS:
                # a trial that lost: the other way longer before the next; else the costs crossed: watch closely
                trial_lost = self._trial and other is not None
                self.probe_every = min(2 * self.probe_every, self.PROBE_EVERY_MAX) if trial_lost else self.PROBE_EVERY
                return self._switch()
        elif self._trial and self._steps > self.TRIAL_STEPS:  # a trial that won: this way is now the cheaper
            self._trial = False
            self.probe_every = self.PROBE_EVERY
        elif self._steps > self.probe_every:  # the cheaper way: the other gets a trial now and then
            return self._switch(trial=True)
        return False

    def drafts_off(self) -> bool:
        """Speculation stopped paying while verify steps ran ahead: ahead's fix-ups may be what made them too dear (a
        host-bound model), so the pipelined way gets its turn, unless it was measured the slower (then it would pay
        there even less). Returns whether the way switched."""
        if self.pinned is not None or not self.ahead:
            return False
        ahead, pipelined = self.period[True], self.period[False]
        if ahead is not None and pipelined is not None and pipelined > ahead:
            return False
        return self._switch()

    @classmethod
    def from_env(cls, decode_step_s: float | None = None) -> RunAheadChoice:
        return cls(run_ahead_setting(decode_step_s))

    def _switch(self, trial: bool = False) -> bool:
        self.ahead = not self.ahead
        self.num_switches += 1
        self._steps = 0
        self._trial = trial
        return True


# The device's batch-1 decode step (its CUDA graph replayed at start-up: workers/cuda_graphs.py `time_decode`) from
# which verify steps run ahead by default (PAGODA_SPEC_RUN_AHEAD unset or `device`). Launching ahead hides the host's
# step under the device's but costs the host more launches: a host-bound model's verify step took 1.7-1.9 ms of the
# host ahead against 1.1-1.4 pipelined on the H200 (the tiny model, forced drafts), so ahead pays once the device's
# own step is longer than that; Llama-3-8B's (4.3 ms) verify step cost 1.04-1.05 plain steps ahead against 1.12
# pipelined (H200 and H100), SmolLM2-135M's copy workload (a device step well under 1 ms) ran 1.5-2.1x pipelined
# against 0.5-1.0x ahead (README, Speculative decoding).
RUN_AHEAD_MIN_DEVICE_STEP_S = 1.5e-3


def run_ahead_setting(decode_step_s: float | None = None) -> bool | None:
    """PAGODA_SPEC_RUN_AHEAD: True for 1 (always ahead), False for 0 (never: the workers then keep no token histories
    for the lookup), None for auto (measured while serving: RunAheadChoice); unset or `device` (the default), by the
    device's batch-1 decode step `decode_step_s` (seconds; None where unmeasured, as on a CPU or without CUDA
    graphs: pipelined): ahead from RUN_AHEAD_MIN_DEVICE_STEP_S."""
    value = _run_ahead_value()
    if value == "device":
        return decode_step_s is not None and decode_step_s >= RUN_AHEAD_MIN_DEVICE_STEP_S
    pinned = _PINNED.get(value)
    if pinned is None and value != "auto":
        logger.warning("PAGODA_SPEC_RUN_AHEAD=%r is not device, auto, 1 or 0: using auto", value)
    return pinned


def may_run_ahead() -> bool:
    """Whether verify steps may run ahead under PAGODA_SPEC_RUN_AHEAD (all but 0), so that the workers keep the
    n-gram lookup's token histories (a worker knows nothing of the engine's measured choice)."""
    return _PINNED.get(_run_ahead_value()) is not False


_PINNED = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _run_ahead_value() -> str:
    return str(envs.get("PAGODA_SPEC_RUN_AHEAD")).strip().lower()


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step gives with k drafts each accepted with probability `acceptance` (independently):
    (1 - a^(k+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class SpecDecoder:
    """Proposes drafts for the running requests before each schedule() (the scheduler trims them to its budget),
    when speculating pays: `should_speculate` weighs the tokens a verify step is expected to give (the acceptance
    measured over the last ACCEPTANCE_STEPS steps with drafts) against its cost over a plain step (`StepCostModel`,
    from the engine's own step times) plus the proposer's (`propose_s`: a draft model's passes before the step), so
    large batches, where a step's extra positions cost nearly what they give, and output the proposer cannot
    predict run without drafts (and with overlapped steps again). One step in PROBE_EVERY without drafts probes
    (in batches of up to PROBE_MAX_BATCH): up to PROBE_REQUESTS requests get drafts, so the acceptance follows the
    output (a copy that starts after a preamble turns speculation on within a few steps) at the cost of a few extra
    tokens and one step without overlap. After PROBE_PATIENCE probes in a row whose drafts gave nothing, each further
    one doubles the steps to the next, up to PROBE_EVERY_MAX (output the proposer never predicts: the 8B preset's
    random weights, where probes every 8 steps made its steps 8% slower than plain at batch 1 and 18% at batch 32
    on the H200); an accepted draft resets it."""

    PROBE_EVERY = 8
    PROBE_PATIENCE = 4
    PROBE_EVERY_MAX = 128
    PROBE_REQUESTS = 4
    # No probe in a step of more requests: verify steps run under CUDA graphs up to this batch (workers/cuda_graphs.py
    # MAX_VERIFY_BATCH), a larger one eagerly, several times a plain step's time on a GPU (34 against 4.3 ms at batch
    # 1 on the H200), and speculation rarely pays there anyway
    PROBE_MAX_BATCH = 64
    ACCEPTANCE_STEPS = 8  # the acceptance is the ratio over the last steps that had draft positions
    PROPOSE_DECAY = 0.9  # the proposer's time a step: a decaying average

    def __init__(self, config: SpeculativeConfig, executor: Executor | None = None):
        self.config = config
        self.proposer: Proposer | BatchProposer
        if config.method == "draft_model":
            assert executor is not None, "a draft model runs on the executor's workers"
            self.proposer = DraftModelProposer(executor)
        else:
            self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                          config.prompt_lookup_max)
        self.cost = StepCostModel()
        self.recent: deque[tuple[int, int]] = deque(maxlen=self.ACCEPTANCE_STEPS)  # (draft positions, accepted)
        self.num_steps_off = 0  # steps that had decoding requests and no drafts by this decision
        self.num_steps_ahead = 0  # steps with drafts launched before the step in flight was read (device drafts)
        self.run_ahead = RunAheadChoice.from_env(executor.decode_step_s if executor is not None else None)
        self.propose_s: float | None = None  # the proposer's time a step that asked it (recent average)
        self.propose_total_s = 0.0  # the proposer's time over all steps (benchmarks take differences)
        self.token_arrays = TokenArrays()  # the n-gram lookup's view of each request's tokens
        self._steps_since_drafts = 0
        self._failed_probes = 0  # steps in a row whose drafts gave nothing

    @property
    def acceptance(self) -> float | None:
        """Accepted drafts over draft positions in the recent steps; None until a step had draft positions."""
        positions = sum(n for n, _ in self.recent)
        return sum(a for _, a in self.recent) / positions if positions else None

    def should_speculate(self, num_running: int) -> bool:
        """Whether a step of `num_running` requests pays with drafts for all of them (and runs without overlap)."""
        limit = self.config.disable_by_batch_size
        if limit is not None:
            return num_running <= limit
        acceptance = self.acceptance
        if num_running == 0 or acceptance is None:
            return True
        k = self.config.num_speculative_tokens
        gain = expected_tokens(acceptance, k)
        if gain <= 1.0:  # nothing accepted: no verify step can pay, whatever it costs
            return False
        # the drafts' own cost too: the proposer's time before the step
        ratio = self.cost.ratio(num_running, num_running * (1 + k), self.propose_s or 0.0)
        return ratio is None or gain > ratio

    def record_propose(self, seconds: float) -> None:
        """A step's proposer time (a draft model's passes, the n-gram lookup): its average moves toward it."""
        self.propose_total_s += seconds
        self.propose_s = seconds if self.propose_s is None else (
            self.PROPOSE_DECAY * self.propose_s + (1 - self.PROPOSE_DECAY) * seconds)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """A step's drafts scored (with the positions `propose` found no draft for, as not accepted)."""
        if num_draft_tokens:
            self.recent.append((num_draft_tokens, num_accepted))
            self._failed_probes = 0 if num_accepted else self._failed_probes + 1

    @property
    def probe_every(self) -> int:
        """Steps without drafts before a probe."""
        doublings = min(max(self._failed_probes - self.PROBE_PATIENCE, 0), 16)
        return min(self.PROBE_EVERY << doublings, self.PROBE_EVERY_MAX)

    def decide(self, num_running: int) -> int:
        """This step's decision: how many of its running requests may get drafts (0: none, the step may overlap;
        all of them where `should_speculate`; PROBE_REQUESTS in a probe step), counted. Drafts turned off while
        verify steps ran ahead by their cost (drafts were accepted) turn them on pipelined first
        (RunAheadChoice.drafts_off), the costs measured again."""
        speculate = self.should_speculate(num_running)
        if (not speculate and num_running and self.config.disable_by_batch_size is None
                and (self.acceptance or 0.0) > 0.0 and self.drafts_on_device and self.run_ahead.drafts_off()):
            self._switched()
            speculate = self.should_speculate(num_running)
        if speculate:
            return num_running
        if not num_running:
            return 0
        if (self.config.disable_by_batch_size is None and self._steps_since_drafts >= self.probe_every
                and num_running <= self.PROBE_MAX_BATCH):
            # (until `propose` asks: a step that leaves overlap first drains the step in flight, without drafts)
            return min(num_running, self.PROBE_REQUESTS)
        self._steps_since_drafts += 1
        self.num_steps_off += 1
        return 0

    @property
    def drafts_on_device(self) -> bool:
        """Whether the workers can propose this method's drafts themselves (kernels/ngram.py: the n-gram
        lookup over their device token histories), so that a step with drafts may be launched before the one in
        flight is read back: the n-gram proposer's. A draft model reads its catch-up tokens on the host: no."""
        return isinstance(self.proposer, NgramProposer) and self.run_ahead.pinned is not False

    @property
    def can_run_ahead(self) -> bool:
        """Whether a step may be launched before the step in flight (a verify step, or one that would get device
        drafts) is read back: the workers propose the drafts and the measured choice (RunAheadChoice) says so. A
        grammar's rows then need an executor that defers sampling (engine/llm_engine.py `_can_overlap`)."""
        return self.drafts_on_device and self.run_ahead.ahead

    def record_verify_period(self, ahead: bool, seconds: float) -> None:
        """A verify step read back `seconds` after the verify step before it (RunAheadChoice)."""
        if self.drafts_on_device and self.run_ahead.record(ahead, seconds):
            self._switched()

    def _switched(self) -> None:
        """Verify steps now launch the other way: the step costs measured the old way leave the cost model (they
        priced its verify steps: ahead, a host-bound model's cost several times the pipelined one's)."""
        self.cost.clear()

    def propose(self, running: list[Request], max_requests: int, on_device: bool = False) -> int:
        """Drafts for up to `max_requests` of the running requests that can take them (none for the others): one
        call of a BatchProposer for all of them, or the Proposer for each. Returns the draft positions it was asked
        for and found nothing to fill (a request the n-gram lookup finds no match for): to `observe` as drafts not
        accepted, so a proposer that finds nothing turns speculation off as one whose drafts are all rejected
        would."""
        k = self.config.num_speculative_tokens
        asked: list[Request] = []
        rooms: list[int] = []
        for req in running:
            req.spec_token_ids = []
            # the step samples one token of its own too (counting the drafts in flight as accepted: the room left)
            room = min(k, req.max_tokens - (req.num_known_tokens - req.num_prompt_tokens) - 1)
            if len(asked) < max_requests and room > 0 and can_speculate(req, on_device):
                asked.append(req)
                rooms.append(room)
        if not asked:
            return 0
        self._steps_since_drafts = 0
        if on_device:  # the workers fill these positions (their lookups come out in the acceptance)
            for req, room in zip(asked, rooms):
                req.spec_token_ids = [DEVICE_DRAFT] * room
            return 0
        start = time.perf_counter()
        propose_batch = getattr(self.proposer, "propose_batch", None)  # a BatchProposer (no Protocol check a step)
        if propose_batch is not None:
            drafts = propose_batch(asked, rooms)
        else:
            propose = cast(Proposer, self.proposer).propose
            drafts = [propose(self.token_arrays.get(r)) for r in asked]
            self.token_arrays.keep_only({r.req_id for r in running})
        self.record_propose(time.perf_counter() - start)
        missed = 0
        for req, room, d in zip(asked, rooms, drafts):
            d = list(d[:room])  # a grammar keeps the longest prefix it accepts
            req.spec_token_ids = req.grammar.valid_prefix(d) if req.grammar is not None and d else d
            missed += room - len(req.spec_token_ids)
        return missed


def can_speculate(req: Request, on_device: bool = False) -> bool:
    """A decode step (its last token is the only one not in the KV cache) of a request without a grammar or whose
    grammar is ready (its drafts are cut to what the grammar accepts, and each position is masked). Drafts on the
    host need its tokens there (no step in flight for it); device drafts follow the tokens of a step in flight."""
    if req.grammar is not None and not req.grammar.is_ready:
        return False
    if on_device:
        return req.num_computed_tokens == req.num_known_tokens - 1
    return req.num_pending_tokens == 0 and req.num_computed_tokens == req.num_tokens - 1

