"""One request, one state machine: everything the gateway knows and holds for a request,
and every change to it, with no I/O and no clock (in the manner of h11's ``_state``).

One door out, one door in. ``next()`` names the one act the driver
(``gateway.proxy.handler``) performs next (an ``Act``: a read of the lease, a slot, the
body, the admission, a wait, the last look before the send, the release of a claim), or
answers with the ``Verdict`` once the decision table (``decision``) has one: forward,
pass, replay or refuse. The driver performs the act and feeds what it found back through
``feed`` as the act's event (``LeaseSeen``, ``SlotTaken``, ``BodyRead``, ``BodyLate``,
``Admitted``, ``FirstSettled``, ``OlderSettled``, ``ClaimSeen``, ``Released``; a time in
an event is the driver's reading of the clock); an event that is not an answer to the act
asked for raises ``MachineError``. The rules it applies are ``fence``'s and
``decision``'s; its deadlines are ``deadlines``'s.

Which act follows which (``decide`` names each fact's act; ``_lease_act`` chooses how
the lease is found out):

    lease unknown ─ body still coming (or over the limit), or a second look ─> CHECK_LEASE
                  └ body arrived ─> TAKE_SLOT ─> READ_BODY ─> ADMIT   (the admission tells)
    slot ─> TAKE_SLOT        body ─> READ_BODY        record ─> ADMIT
    first attempt in flight, asked to wait ─> WAIT_FIRST (slot and body given back)
          ─ settled ─> CHECK_LEASE ─> the record's answer (a replay, a refusal);
          the key free again ─> request-in-progress
    older writes in flight ─> WAIT_OLDER ─ settled ─> CHECK_LEASE (judged after the wait)
    at the send ─> READ_CLAIM (unless the admission, fresh, was itself that judgement)
    refused with a claim held ─> RELEASE ─> the verdict

Once the verdict to forward is carried out (``forwarding``: from here on the write may
be sent), the exchange's end is an event too: ``exchange_ended`` (not sent, no answer, or
what the upstream's answer means for the key) returns the key's fate
(``after_forward.FATES``), ``fate_performed`` says whether the database took it, and
``answer_after`` is the gateway's own answer where no upstream answer is streamed back.
Any failure outside the exchange (the database, a bug) ends in ``failed()``: nothing was
sent before the forward began (``store-unavailable``), after it whether anything was is
unknown (``internal-error``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace

from multidict import CIMultiDict

from gateway.fencing import fence
from gateway.fencing.after_forward import FATES, Ended, Fate, answer_after
from gateway.fencing.deadlines import (
    BEHIND_WAIT_SECONDS,
    FRESH_ADMISSION,
    DuplicateWait,
    Timing,
    send_left,
)
from gateway.fencing.decision import (
    INTERNAL_ERROR,
    STORE_UNAVAILABLE,
    UNKNOWN,
    Act,
    Facts,
    Outcome,
    Verdict,
    decide,
)
from gateway.fencing.events import (
    ANSWERS,
    Admitted,
    BodyLate,
    BodyRead,
    ClaimSeen,
    Event,
    FirstSettled,
    LeaseSeen,
    OlderSettled,
    Released,
    SlotTaken,
)
from gateway.fencing.fence import Admission, ClaimState, Record, UnknownOutcome


class MachineError(RuntimeError):
    """The machine was fed an event it did not ask for (h11's ``LocalProtocolError``): a
    bug in the driver, never a request's fault."""


@dataclass(frozen=True, slots=True)
class Claim:
    """The key is this request's: claimed, or taken over, under ``attempt``."""

    attempt: str
    back_to: Record | None  # the record before we took it over
    send_by_monotonic: float  # after which the write stays unsent (time.monotonic())


@dataclass(slots=True)
class RequestMachine:
    """One request's facts and holdings, and the transitions between them."""

    facts: Facts
    started: float  # time.perf_counter() when the request was taken (the driver's clock)
    timing: Timing | None = None  # None: no upstream (refused before any act)
    body_arrived: bool = False  # the whole body was in when the request was taken
    resolving: bool = False  # some upstream's unknown outcomes are re-sent by the gateway
    policy: UnknownOutcome = UnknownOutcome.HOLD  # the upstream's ``unknown_outcome``
    wait: DuplicateWait | None = None  # ``Prefer: wait``, capped; or granted (behind)
    slot: str | None = None  # the pool whose slot this request holds
    body: io.BytesIO | None = None  # the request body, read once (the only copy)
    fingerprint: str | None = None
    admission: Admission | None = None  # the latest look at the lease (and the key)
    record: Record | None = None  # the key's record, when it answers for the request
    claim: Claim | None = None
    send_left: float | None = None  # seconds the claim still allows, judged at the send
    forwarded: CIMultiDict[str] | None = None  # the headers a fenced write went with
    sending: bool = False  # the forward has begun: from here on, the write may be sent
    ended: Ended | None = None  # how the forward's exchange ended
    kept: bool | None = None  # what its end does to the key was written (None: no key)
    asked: Act | None = None  # the act ``next()`` named last; None: a verdict
    _keyed: bool = False  # a claim on the key was held when the exchange ended
    _after_wait: bool = False  # the lease is being judged again after WAIT_OLDER

    # -- the door out: what to do next --------------------------------------------------

    def next(self) -> Act | Verdict:
        """The act to perform next, or the verdict to carry out."""
        found = decide(self.facts)
        if found is Act.CHECK_LEASE:
            found = self._lease_act()
        elif isinstance(found, Verdict) and found.outcome is Outcome.REFUSE and self.claim:
            found = Act.RELEASE  # our claim on the key: not sent, undone first
        self.asked = found if isinstance(found, Act) else None
        return found

    def _lease_act(self) -> Act:
        """Over the limit, the body still on the way, or a second look (after a wait):
        a read of the lease, before a slot is taken and the body read. Once the body has
        all arrived it cannot hold a slot for long: take one, read it and let the
        admission (the one statement that decides) tell about the lease, instead of
        asking twice."""
        facts = self.facts
        if facts.over_limit is True or not self.body_arrived or self.admission is not None:
            return Act.CHECK_LEASE
        if facts.slot_free is UNKNOWN:
            return Act.TAKE_SLOT
        if facts.slot_free is True and facts.over_limit is UNKNOWN:
            return Act.READ_BODY
        if facts.slot_free is True and facts.over_limit is False and facts.body_in_time:
            return Act.ADMIT
        return Act.CHECK_LEASE

    @property
    def claim_seconds(self) -> float:
        """Seconds the claim the ADMIT act asks for lasts."""
        assert self.timing is not None
        return self.timing.claim_seconds

    # -- the door in: what the act found --------------------------------------------------

    def feed(self, event: Event) -> Act | Verdict:
        """What the act asked for found; then what to do next. An event that does not
        answer the act asked for is the driver's bug (``MachineError``)."""
        asked = self.asked
        if asked is None or not isinstance(event, ANSWERS[asked]):
            raise MachineError(f"{event!r} does not answer {asked}: {self!r}")
        match event:
            case LeaseSeen():
                self._lease_seen(event.admission)
            case SlotTaken():
                self.slot = event.pool
                self.facts.slot_free = event.pool is not None
            case BodyRead():
                self.body, self.fingerprint = event.body, event.fingerprint
                self.facts.over_limit, self.facts.body_in_time = event.body is None, True
            case BodyLate():
                self.facts.over_limit, self.facts.body_in_time = False, False
            case Admitted():
                self._admitted(event)
            case FirstSettled():
                self._first_settled(event.settled, event.record)
            case OlderSettled():
                self._older_settled(event.settled)
            case ClaimSeen():
                self._claim_seen(event.claim, event.now_monotonic)
            case Released():
                self.claim = None
        return self.next()

    def slot_given_back(self) -> None:
        """The driver gave the request's slot back (the one change it may make at any
        time: before a long wait, and as the request ends)."""
        self.slot = None

    def before_body(self) -> None:
        """``Expect: 100-continue``: judged as if the slot were taken (the driver takes it
        for the body), so only the refusals that need no body are given."""
        self.facts.slot_free = True

    def body_coming(self) -> None:
        """``Expect: 100-continue`` let the body come: the slot is to be taken now."""
        self.facts.slot_free = UNKNOWN

    def _lease_seen(self, admission: Admission | None) -> None:
        """After the wait for older writes, a newer generation admitted meanwhile makes
        a current lease stale."""
        facts = self.facts
        after_wait, self._after_wait = self._after_wait, False
        if after_wait:
            facts.older_settled = True
        if admission is None:  # unknown, or its grant purged meanwhile
            facts.lease = fence.UNKNOWN_TOKEN
            return
        generation = self._generation() if after_wait else None
        self.admission = admission
        facts.lease = admission.lease
        if generation is not None:
            facts.lease = fence.lease_after_wait(admission.lease, admission.highest, generation)

    def _admitted(self, event: Admitted) -> None:
        facts, admission = self.facts, event.admission
        if admission is None:
            facts.lease = fence.UNKNOWN_TOKEN
            return
        self.admission = admission
        facts.lease = admission.lease  # judged once, when the store read the answer
        if facts.lease is not None:
            return
        if admission.attempt is not None:
            self._claimed(admission, event.asked_monotonic, event.answered_monotonic)
            return
        # The key has a record not ours (or gone between claim and read): what it answers.
        assert self.fingerprint is not None and self.timing is not None
        self.record = admission.record
        facts.record = fence.record_reason(admission.record, self.fingerprint, self.policy)
        if fence.in_progress(facts.record):
            self._may_wait(event.answered_monotonic, behind=event.behind, gone=event.gone)

    def _claimed(self, admission: Admission, asked: float, answered: float) -> None:
        """The key is ours: wait for older writes if any are in flight; an admission
        answered at once, with none in flight and no resolver running, is itself the
        judgement before the send (``FRESH_ADMISSION``)."""
        assert admission.attempt is not None and self.timing is not None
        facts = self.facts
        send_by = self.timing.send_by_monotonic(asked)
        self.claim = Claim(admission.attempt, admission.back_to, send_by)
        facts.record = None
        facts.older_settled = UNKNOWN if admission.older_in_flight else True
        if (
            facts.older_settled is True
            and not self.resolving
            and answered - asked < FRESH_ADMISSION
        ):
            self._judge_send(admission.highest, send_by - answered)

    def _may_wait(self, now: float, *, behind: bool, gone: bool) -> None:
        """The key is in flight under another request: ``request-in-progress``, unless
        the request asked to wait (``Prefer: wait``) and its wait has time left, or its
        answer has gone out from this replica and its record is being settled here
        (``behind``): then it waits for that, as if it had asked."""
        if self.wait is None and behind:
            self.wait = DuplicateWait(BEHIND_WAIT_SECONDS, asked=False)
        if self.wait is None:
            return
        self.wait.begin(now)
        if self.wait.left(now) > 0 and not gone:
            self.facts.first_settled = UNKNOWN
            # A waiter is answered from the store, never forwarded: it needs its
            # fingerprint, not its body (which would otherwise stay in memory for the
            # whole wait, outside the slots' bound).
            self.body = None

    def _first_settled(self, settled: bool, record: Record | None) -> None:
        """A stored answer (or a refusal the record gives: reused key, unknown outcome)
        is this waiter's, once the lease is looked at again: no slot is needed for an
        answer from the store. A key free again (released, "not processed", to be
        forwarded again) has no answer to give: the waiter, never sent, is told to send
        again (``request-in-progress``, with ``Retry-After``)."""
        assert self.wait is not None and self.fingerprint is not None
        self.wait.waited = True
        reason = fence.record_reason(record, self.fingerprint, self.policy) if settled else None
        if reason is None or fence.in_progress(reason):
            self.facts.first_settled = False
            return
        self.facts.first_settled = True
        self.record, self.facts.record = record, reason
        self.facts.lease = UNKNOWN  # looked at again (CHECK_LEASE: a second look)

    def _older_settled(self, settled: bool) -> None:
        """Settled: the lease is judged again (a newer generation may have been granted
        or admitted meanwhile); else ``ordering-timeout``."""
        if not settled:
            self.facts.older_settled = False
            return
        self._after_wait = True
        self.facts.lease = UNKNOWN  # looked at again (CHECK_LEASE: a second look)

    def _claim_seen(self, claim: ClaimState, now: float) -> None:
        """A claimed write judged once more right before its first byte goes out. A
        replica that stalled since its admission must not send once a newer generation
        has been admitted, nor once its claim is so near its deadline that other
        replicas may stop waiting for it."""
        assert self.claim is not None and self.admission is not None
        left = send_left(self.claim.send_by_monotonic, now, claim.deadline, claim.now)
        self._judge_send(claim.fence, left)
        if self.facts.at_send is None and claim.older_in_flight:
            # An older write went in flight after the admission's snapshot (the resolver
            # re-claimed one): wait for it as for any older write, then judge again.
            # Each of the two reads its own snapshot after the other's commit or before
            # it, so either this read sees its claim or the resolver sees our fence.
            self.facts.older_settled = self.facts.at_send = UNKNOWN
        if claim.fence is not None and claim.fence > (self.admission.highest or 0):
            # A newer generation was admitted meanwhile: the highest known, for the answer.
            self.admission = replace(self.admission, highest=claim.fence)

    def forwarding(self, headers: CIMultiDict[str]) -> None:
        """The verdict to forward is being carried out with ``headers`` (kept, unsigned,
        for a re-send): from here on, bytes of the write may reach the upstream, and no
        answer may say it was never sent unless the exchange itself says so."""
        self.sending = True
        self.forwarded = headers.copy()

    def exchange_ended(self, ended: Ended) -> Fate | None:
        """The forward's exchange ended: not sent, no answer, or an answer whose meaning
        for the key is ``ended``. What becomes of the key (None: the request holds none,
        as a pass-through). Fed once, and only once the forward began."""
        if not self.sending or self.ended is not None:
            raise MachineError(f"the exchange ended ({ended}) when it could not: {self!r}")
        self.ended, self._keyed = ended, self.claim is not None
        return FATES[ended] if self._keyed else None

    def fate_performed(self, kept: bool) -> None:
        """The key's fate performed; ``kept``: the database took it (else, for a sent
        write, its claim stays in flight and turns unknown at its deadline: the worker is
        told so, never that nothing was sent)."""
        if self.ended is None or not self._keyed or self.kept is not None:
            raise MachineError(f"a key's fate performed when none was asked: {self!r}")
        self.kept = kept

    def answer_after(self) -> Verdict:
        """The gateway's own answer to an exchange that brought no answer to stream back
        (the upstream not reached, no answer, a precondition not met)."""
        if self.ended is None:
            raise MachineError(f"an answer after an exchange that has not ended: {self!r}")
        return answer_after(self.ended, keyed=self._keyed, kept=self.kept is not False)

    def failed(self) -> Verdict:
        """The answer to a request that failed (the database, or a bug) outside the
        exchange: nothing was sent before the forward began; after, whether anything
        was is unknown (``internal-error``, sent maybe), never "send it again"."""
        return INTERNAL_ERROR if self.sending else STORE_UNAVAILABLE

    @property
    def unsent_claim(self) -> bool:
        """A claim on the key is held for a write that was never sent: it is to be given
        back however the request ends (refused, failed, cancelled)."""
        return self.claim is not None and not self.sending

    # -- reading the state ----------------------------------------------------------------

    def _judge_send(self, fenced: int | None, seconds_left: float) -> None:
        self.send_left = seconds_left
        self.facts.at_send = fence.send_verdict(self._generation(), fenced, seconds_left)

    def _generation(self) -> int:
        assert self.admission is not None and self.admission.presented is not None
        generation = self.admission.presented.generation
        assert generation is not None
        return generation

    @property
    def job_id(self) -> str:
        assert self.admission is not None and self.admission.presented is not None
        return self.admission.presented.job_id

    @property
    def generation(self) -> int:
        """The presented lease's generation (a write past its admission)."""
        return self._generation()

    @property
    def decided(self) -> bool:
        """The lease was looked at (the decision's time is measured from the start)."""
        return self.admission is not None
