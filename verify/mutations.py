"""The mutants of ``python -m verify mutants``: small, plausible bugs in the rules the
verification checks, each a set of text edits to the tree.

A mutant is what a careless change to one rule would look like: a comparison off by one,
a wrong column, a condition dropped from a branch, a few seconds of slack. Each is
applied to a copy of the tree (``apply``), never to this one. Every ``old`` text occurs
exactly once in its file, so a refactor that moves the code makes ``apply`` fail loudly
(``tests/unit/test_verify_mutations.py`` applies every mutant to the tree as it is) rather
than leaving a mutant that changes nothing.

Each mutant names the rule it breaks, the databases on which it changes the behaviour of
a verification run (none: a layer the workload cannot reach, or one another layer masks
for it; ``python -m verify mutants`` lists those as its blind spots instead of running
them) (a PostgreSQL-only statement, or a clock that only differs from the
authoritative one on PostgreSQL), and ``killed_by``: an existing test that fails under
it, run against a mutated copy. ``fast`` marks the few that a short verification on
SQLite under pauses, kills and upstream faults is most likely to catch.

Several layers stand behind each rule (the lease check, the ordering barrier, the fence
judged again right before the send), so some mutants break one layer that another still
covers for the workload ``verify`` runs: ``why`` says so where it is the case. Those are
the ones a verification run is not expected to kill; a unit or integration test does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

RULES: Final = frozenset(
    {"fence", "barrier", "expiry", "duplicates", "unknown-outcomes", "resolver", "lease-source"}
)
DATABASES: Final = frozenset({"sqlite", "pg"})
BOTH: Final = DATABASES
PG: Final = frozenset({"pg"})
SQLITE: Final = frozenset({"sqlite"})
UNREACHABLE: Final[frozenset[str]] = frozenset()


@dataclass(frozen=True)
class Edit:
    """Replace ``old``, which occurs exactly once in ``path``, with ``new``."""

    path: str  # relative to the repository's root, e.g. "lease_core/sql/postgresql.sql"
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    """One plausible bug: the rule it breaks, where it changes behaviour, its edits."""

    name: str  # short kebab-case id, e.g. "fence-job-lease"
    rule: str  # one of RULES
    databases: frozenset[str]  # a subset of DATABASES; empty: verify cannot reach it
    edits: tuple[Edit, ...]
    why: str  # the plausible bug it models
    fast: bool = False  # in the fast subset that CI runs on SQLite
    killed_by: str = ""  # an existing test that fails under it (its node id)
    # ``verify run`` arguments its runs need, and its baseline's (the same workload): a
    # layer only such a workload exercises, which another would mask for other mutants
    run_args: tuple[str, ...] = ()
    pending: str = ""
    """The change whose text the edits replace, when it is not in the tree yet: until it
    is, ``apply`` refuses the mutant, its tests skip it and ``verify mutants`` lists it
    without running it. Once merged: fill in the texts and remove ``pending``."""


class MutationError(Exception):
    """A mutant cannot be applied (its text is missing or not unique), or is unknown."""


_COMMON = "lease_core/sql/common.sql"
_POSTGRES = "lease_core/sql/postgresql.sql"
_FENCE = "gateway/fencing/fence.py"
_HANDLER = "gateway/proxy/handler.py"
_MACHINE = "gateway/fencing/machine.py"
_STORE = "gateway/records/store.py"
_ZOOKEEPER = "gateway/sources/zookeeper.py"

# Issue 44: the gateway binds (source, lock, generation) to the first holder admitted,
# in the conflict clause of ``admit_external`` (lease_core/sql/common.sql), and refuses
# another holder presenting that generation (409 generation-reissued). The mutant drops
# the holder's comparison.
_REISSUE_CHECK = "AND COALESCE(fences.holder, excluded.holder) = excluded.holder)"
_REISSUE_CHECK_DROPPED = "AND TRUE)"

MUTANTS: Final[tuple[Mutant, ...]] = (
    Mutant(
        name="fence-job-lease",
        rule="fence",
        databases=BOTH,
        edits=(
            Edit(
                _COMMON,
                "lease_token_hash = :token_hash AND {lease_current(jobs)}",
                "job_id = (SELECT job_id FROM leases WHERE token_hash = :token_hash)"
                " AND {lease_current(jobs)}",
            ),
            Edit(
                _COMMON,
                "    WHEN {job}.generation = {grant}.generation AND {job}.owner = {grant}.owner\n"
                "         AND {lease_current({job})} THEN NULL\n",
                "    WHEN {lease_current({job})} THEN NULL\n",
            ),
        ),
        why=(
            "The lease check asks whether the token's job has a current lease instead of "
            "whether the token's own grant is that lease (the lease API's statements and "
            "the admission's verdict, lease_refusal), so a generation-1 token writes, renews and "
            "completes after generation 2 was granted; the fence judged at the send still "
            "refuses it once generation 2 has been admitted, and on SQLite the stale "
            "write's marker carries the job's generation, so generation 2 does not wait "
            "for it."
        ),
        fast=True,
        killed_by=(
            "tests/integration/test_gateway_fencing.py"
            "::test_delayed_worker_is_refused_after_reclaim"
        ),
    ),
    Mutant(
        name="fence-send-off-by-one",
        rule="fence",
        databases=UNREACHABLE,
        edits=(
            Edit(
                _FENCE,
                "    if superseded(generation, fence):",
                "    if superseded(generation + 1, fence):",
            ),
        ),
        why=(
            "The judgement right before the send lets a write through while the job's "
            "fence is one generation above it, so a replica that stalled between its "
            "admission and the send sends generation g after g+1 was admitted "
            "(tests/faults/test_frozen_replica.py"
            "::test_woken_after_a_newer_generation_was_admitted fails too). For the "
            "gateway's own leases two layers mask it in a verification: the barrier "
            "makes g+1 wait for g until g's deadline, and past that deadline the stalled "
            "replica does not send g at all (ordering-timeout). When it does send g after "
            "g+1 was admitted, g still reaches the upstream before every write of g+1 (g+1 "
            "waits for it), which no history tells from a correct replica frozen right "
            "after its last look (docs/verification.md, 'What the harness still cannot "
            "see'; issue 53 found no sound invariant for it)."
        ),
        killed_by="tests/unit/test_send_verdict.py::test_send_verdict",
    ),
    Mutant(
        name="barrier-quick-admission",
        rule="barrier",
        databases=BOTH,
        edits=(
            Edit(
                _MACHINE,
                "        facts.older_settled = UNKNOWN if admission.older_in_flight else True\n",
                "        quick = answered - asked < FRESH_ADMISSION\n"
                "        facts.older_settled = UNKNOWN if admission.older_in_flight and not quick"
                " else True\n",
            ),
        ),
        why=(
            "An admission answered within FRESH_ADMISSION is taken to need no further "
            "judgement, the ordering barrier included, so a newer generation's write goes "
            "out beside an older generation's write still in flight."
        ),
        fast=True,
        killed_by=(
            "tests/unit/test_request_machine.py"
            "::test_an_older_write_in_flight_is_waited_for_however_fast_the_admission"
        ),
    ),
    Mutant(
        name="barrier-off-by-one",
        rule="barrier",
        databases=BOTH,
        edits=(
            Edit(
                _COMMON,
                "    WHERE o.job_id = {grant}.job_id AND o.generation < {grant}.generation"
                " AND {in_flight(o)}",
                "    WHERE o.job_id = {grant}.job_id AND o.generation < {grant}.generation - 1"
                " AND {in_flight(o)}",
            ),
        ),
        why=(
            "The admission's test for an older write in flight counts only generations two "
            "or more below its own (the fragment lease_older_in_flight, both dialects' "
            "admissions), so generation g+1 does not wait for g's write in flight."
        ),
        killed_by=(
            "tests/integration/test_gateway_ordering.py"
            "::test_newer_generation_waits_for_the_older_write_in_flight"
        ),
    ),
    Mutant(
        name="expiry-replica-clock",
        rule="expiry",
        databases=PG,
        edits=(
            Edit(_STORE, "import json\n", "import json\nimport time\n"),
            Edit(
                _STORE,
                '        row = await self.backend.run("admit", token_hash=write.token_hash,'
                " **write.params(attempt))\n",
                "        row = await self.backend.run(\n"
                '            "admit", token_hash=write.token_hash, now=time.time(),'
                " **write.params(attempt)\n"
                "        )\n",
            ),
        ),
        why=(
            "The admission passes the replica's own clock as now, so on PostgreSQL a "
            "replica whose clock is off (the clock nemesis) judges leases by it and dates "
            "its claims' deadlines by it: one that is behind admits under leases the "
            "database has expired, and its writes in flight look overdue to the other "
            "replicas, which stop waiting for them (on SQLite the process's clock is the "
            "authoritative one; the tests' injected clock stands for the database's, so a "
            "SQLite test kills it too)."
        ),
        killed_by=(
            "tests/integration/test_gateway_fencing.py::test_lease_expired_when_nobody_newer"
        ),
    ),
    Mutant(
        name="expiry-grace",
        rule="expiry",
        databases=BOTH,
        edits=(
            Edit(
                _COMMON,
                "{job}.state = {State.LEASED} AND {job}.lease_expires_at > {now}",
                "{job}.state = {State.LEASED} AND {job}.lease_expires_at + 3 > {now}",
            ),
        ),
        why=(
            "Three seconds of grace for clock drift in the current-lease check (the shared "
            "fragment lease_current, which every dialect's statements use), so "
            "a lease writes, renews and completes for three seconds after it expired; a "
            "takeover still fences it off (claims judge claimable_at), so only a write "
            "invoked after its lease's expiry with no successor shows it (invariant 11, "
            "the lapse and pause workloads)."
        ),
        fast=True,
        killed_by=(
            "tests/integration/test_gateway_fencing.py::test_lease_expired_when_nobody_newer"
        ),
    ),
    Mutant(
        name="expiry-claim-early",
        rule="expiry",
        databases=BOTH,
        edits=(
            Edit(
                _COMMON,
                "{job}.claimable_at IS NOT NULL AND {job}.claimable_at <= {now}\n",
                "{job}.claimable_at IS NOT NULL AND {job}.claimable_at <= {now} + 0.5\n",
            ),
        ),
        why=(
            "A queue's claim takes a job half a second before it is claimable (found by an "
            "independent review's mutant, issue 53), so a lease is handed to the next "
            "generation while the old holder's is still current: the gateway still fences "
            "the old holder off, so only the lease's own promise breaks. The workers' solo "
            "rounds (a job of a queue of their own, left to lapse and claimed again as soon "
            "as the queue gives it) reach it, invariant 15."
        ),
        killed_by=(
            "tests/integration/test_lease_api.py"
            "::test_expired_lease_is_reclaimed_with_a_higher_generation"
        ),
    ),
    Mutant(
        name="duplicates-forget-completed",
        rule="duplicates",
        databases=BOTH,
        edits=(
            Edit(
                _STORE,
                "        if fence.is_anonymous(key) and state is RecordState.COMPLETED:",
                "        if fence.is_anonymous(key) or state is RecordState.COMPLETED:",
            ),
        ),
        why=(
            "The settle forgets every completed record, not only those of writes without "
            "a key, so a retried key (or a new generation repeating a step) is forwarded "
            "again instead of replayed."
        ),
        fast=True,
        killed_by=(
            "tests/integration/test_gateway_idempotency.py::test_replay_gives_the_stored_answer"
        ),
    ),
    Mutant(
        name="duplicates-reused-key-replayed",
        rule="duplicates",
        databases=BOTH,
        edits=(
            Edit(
                _FENCE,
                "    if record.fingerprint != fingerprint:\n"
                "        return Reason.IDEMPOTENCY_KEY_REUSED\n"
                "    state = effective_state(record)\n",
                "    state = effective_state(record)\n"
                "    if record.fingerprint != fingerprint and state is not RecordState.COMPLETED:\n"
                "        return Reason.IDEMPOTENCY_KEY_REUSED\n",
            ),
        ),
        why=(
            "The fingerprint is compared only while the key's record is not completed, so "
            "a request with another body under a used key (a retry that rebuilt its "
            "payload) is answered the first request's stored answer, as if its own effect "
            "had happened."
        ),
        fast=True,
        killed_by=(
            "tests/integration/test_gateway_idempotency.py"
            "::test_same_key_different_request_is_refused"
        ),
    ),
    Mutant(
        name="duplicates-purge-within-retention",
        rule="duplicates",
        databases=BOTH,
        edits=(
            Edit(
                "lease_core/sql/sqlite.sql",
                "AND updated_at < {now} - :older_than\n",
                "AND updated_at < {now} + :older_than\n",
            ),
            Edit(
                _POSTGRES,
                "          AND updated_at < {now} - :older_than\n",
                "          AND updated_at < {now} + :older_than\n",
            ),
        ),
        why=(
            "The retention's cutoff adds the retention to now instead of taking it off "
            "(purge_records, both dialects), so the upkeep purges every completed record, "
            "however young: a retried key, or the next generation repeating a step, is "
            "forwarded again instead of replayed. verify's replicas run the upkeep every "
            "second (a correct purge deletes nothing within a run: retention is a day)."
        ),
        killed_by=(
            "tests/integration/test_gateway_idempotency.py"
            "::test_records_past_retention_are_purged_but_unknown_ones_kept"
        ),
    ),
    Mutant(
        name="unknown-timeout-not-sent",
        rule="unknown-outcomes",
        databases=BOTH,
        edits=(
            Edit(
                "gateway/upstream/errors.py",
                "class NoAnswerInTime(NoAnswer):",
                "class NoAnswerInTime(NotSent):",
            ),
        ),
        why=(
            "A request whose answer did not come in time is classed as never sent, so its "
            "key is released instead of held unknown and the worker's retry is forwarded "
            "again although the upstream may have applied the first."
        ),
        fast=True,
        killed_by=("tests/integration/test_gateway_idempotency.py::test_unknown_outcome_is_held"),
    ),
    Mutant(
        name="unknown-hold-as-retry",
        rule="unknown-outcomes",
        databases=BOTH,
        edits=(
            Edit(
                _HANDLER,
                "            retry=upstream.unknown_outcome == UnknownOutcome.RETRY,",
                "            retry=upstream.unknown_outcome != UnknownOutcome.RESOLVE,",
            ),
        ),
        why=(
            'The admission takes over an unknown outcome\'s key under "hold" as under '
            '"retry" (only "resolve" is left out), so a retry of a write that lost its '
            "answer is forwarded again instead of answered outcome-unknown."
        ),
        fast=True,
        killed_by=("tests/integration/test_gateway_idempotency.py::test_unknown_outcome_is_held"),
    ),
    # Issue 52: what a worker is told when the store fails. The settle of a sent write's
    # unknown outcome left unguarded: the database failing then answers the worker
    # store-unavailable ("never sent, send it again") for a write the upstream got.
    Mutant(
        name="unknown-settle-unguarded",
        rule="unknown-outcomes",
        databases=PG,  # on SQLite the gateway waits 10 s for the lock; workers, 5 s
        edits=(
            Edit(
                "gateway/proxy/held.py",
                "        kept = await settle_quietly(self._perform(fate, answer))",
                "        await self._perform(fate, answer)\n        kept = True",
            ),
            Edit(
                _MACHINE,
                "        return INTERNAL_ERROR if self.sending else STORE_UNAVAILABLE",
                "        return STORE_UNAVAILABLE",
            ),
        ),
        why=(
            "The key's fate after a sent write's exchange is not guarded, and a failure "
            "outside the exchange is answered store-unavailable whether or not the forward "
            "began: when the database fails as a sent write's unknown outcome is settled, "
            "the worker is told store-unavailable (sent never, Retry-After), and a worker "
            "that believes it sends the write again under a new key."
        ),
        killed_by=(
            "tests/integration/test_truthful_answers.py"
            "::test_a_sent_write_is_never_told_the_store_failed"
        ),
    ),
    # Issue 52: a claim given back only when the database failed, not on a cancellation
    # (a shutdown past its grace) or any other end before the send: the write that never
    # left stays in flight and turns unknown at its deadline.
    Mutant(
        name="release-only-on-store-unavailable",
        rule="unknown-outcomes",
        databases=BOTH,
        run_args=("--nemesis", "shutdown"),
        edits=(
            Edit(
                _HANDLER,
                "                except BaseException:  # the database, a cancellation, a bug",
                "                except lease_exc.StoreUnavailable:  # the database",
            ),
            Edit("gateway/proxy/gateway.py", "        gateway.draining.set()", "        pass"),
        ),
        why=(
            "As before issue 52: a shutdown does not end the waits, and the claim of a write "
            "that was never sent is given back only when the database failed. A write "
            "waiting behind an older generation when its replica stops is cancelled past "
            "the grace with its claim kept: after the restart it is an unknown outcome to "
            "resolve, though it never left (invariant 13: the shutdown nemesis sends its "
            "SIGTERM once the replica's /metrics shows a write waiting behind an older "
            "generation's, with an ordering wait of 1 s when shutdown runs alone), in a "
            "run of its own: under all only on some seeds (few shutdowns, and the other "
            "faults excuse much)."
        ),
        killed_by=(
            "tests/integration/test_truthful_answers.py::test_a_cancelled_wait_gives_its_claim_back"
        ),
    ),
    # Found while reading a failure of CI's verification (seed 17807807): a request
    # cancelled while its admission waited for SQLite's lock; the admission committed
    # the claim after.
    Mutant(
        name="admission-claim-orphaned",
        rule="unknown-outcomes",
        databases=SQLITE,
        run_args=("--nemesis", "shutdown"),
        edits=(
            Edit(
                _HANDLER,
                "        admission = await self.releases.admit("
                "leases.admit(self.store, incoming, write), key)",
                "        admission = await leases.admit(self.store, incoming, write)",
            ),
        ),
        why=(
            "As before the fix: a request cancelled while its admission is in the database "
            "(a shutdown past its grace while another replica holds SQLite's lock) stops "
            "waiting for it, but the admission still commits its claim, which nobody knows "
            "of: the write, never sent, is left to turn into an unknown outcome (invariant "
            "13). Verify reaches it with the shutdown nemesis's locked shutdowns on SQLite "
            "(half of them: the SIGTERM while another process holds the write lock and the "
            "replica's admissions wait for it, the lock given up past the grace), in a run "
            "of its own: under all, the kills, freezes and partitions that overlap the "
            "held keys excuse them from invariant 13. On PostgreSQL a cancelled request "
            "cancels its statement too (asyncpg cancels it in the server, and the "
            "transaction rolls back): only a cancellation while the commit's answer is on "
            "its way orphans a claim there, which no run reaches (survived seed 1, 90 s, "
            "--nemesis shutdown, 2026-12-07)."
        ),
        killed_by=(
            "tests/faults/test_cancelled_admission.py"
            "::test_an_admission_cancelled_by_shutdown_gives_its_claim_back"
        ),
    ),
    Mutant(
        name="resolver-window-sign",
        rule="resolver",
        databases=BOTH,
        run_args=("--resolving",),
        edits=(
            Edit(
                "gateway/fencing/deadlines.py",
                "    return dedup_window - timeout - RESOLVE_MARGIN",
                "    return dedup_window + timeout + RESOLVE_MARGIN",
            ),
        ),
        why=(
            "The resolver's window adds the upstream's timeout and the margin instead of "
            "taking them off, so it re-sends a held write after the upstream has forgotten "
            "its key and the write is applied twice (invariant 4, or 3 once an operator "
            "settles it): with verify run --resolving, the upstream dedup (unknown_outcome "
            '= "resolve", a key kept 4 s) gets a share of the jobs, some of whose keys are '
            "cut at every send, so the resolver re-sends them until its window closes. "
            "Only there: a resolving gateway judges every write again before the send, "
            "which masks barrier-quick-admission."
        ),
        killed_by=(
            "tests/unit/test_request_machine.py::test_the_resolver_re_sends_only_inside_the_window"
        ),
    ),
    Mutant(
        name="source-fence-off-by-one",
        rule="lease-source",
        databases=BOTH,
        fast=True,
        edits=(
            Edit(
                _COMMON,
                "    WHERE fences.generation < excluded.generation\n       OR (",
                "    WHERE fences.generation < excluded.generation + 2\n       OR (",
            ),
        ),
        why=(
            "The admission of another source's lease accepts a generation one below the "
            "job's fence and lowers the fence to it, so a signed token of generation 1 "
            "writes after generation 2 wrote. The judgement before the admission "
            "(external_lease) refuses a token already below the fence, so verify's signed "
            "workers (verify/signed.py) reach it with a stalled upload: the token judged "
            "and 100 Continue answered, the next generation signed and written, then the "
            "body sent; generation 1 is then applied after 2 (invariants 1, 2, 6)."
        ),
        killed_by=(
            "tests/integration/test_source_jwt.py"
            "::test_a_lower_generation_is_refused_after_a_higher_one_wrote"
        ),
    ),
    Mutant(
        name="source-redis-lapsed-lock",
        rule="lease-source",
        databases=BOTH,
        edits=(
            Edit(
                "gateway/sources/redis_lock.py",
                "        if held == value:",
                "        if held is None or held == value:",
            ),
        ),
        why=(
            "A Redis lock whose key has lapsed is taken as still held by the token, so a "
            "token whose lock expired or was released (or was never taken) writes until "
            "somebody takes the lock again; verify's lock workers reach it with the "
            "holdings that let a lock of their own lapse and then write (LockWorker.lapse: "
            "nobody else takes that lock), invariant 11."
        ),
        killed_by=("tests/integration/test_source_redis.py::test_an_expired_lock_ends_its_token"),
    ),
    Mutant(
        name="source-generation-reissued",
        rule="lease-source",
        databases=BOTH,
        edits=(Edit(_COMMON, _REISSUE_CHECK, _REISSUE_CHECK_DROPPED),),
        fast=True,
        why=(
            "The admission of another source's lease no longer compares the holder the "
            "job's fence was first admitted for, so when a Redis lock's counter is lost "
            "(FLUSHALL, a restart without persistence) the new holder of a generation "
            "writes alongside the one already admitted under it; the lock workers under "
            "lock-loss break invariant 12."
        ),
        killed_by=(
            "tests/integration/test_source_holders.py::"
            "test_redis_a_regrown_counter_reissues_a_generation_and_its_holder_is_refused"
        ),
    ),
    Mutant(
        name="upstream-bytes-outlive-the-exchange",
        rule="resolver",
        databases=BOTH,
        run_args=("--resolving",),
        edits=(
            Edit(
                "gateway/upstream/connection.py",
                'RESET_ON_CLOSE = struct.pack("ii", 1, 0)',
                'RESET_ON_CLOSE = struct.pack("ii", 0, 0)',
            ),
            Edit(
                "gateway/upstream/connection.py",
                'USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", None)',
                "USER_TIMEOUT = None",
            ),
        ),
        why=(
            "As before the fix CI's verification found: an upstream connection the gateway "
            "drops mid-exchange closes gracefully, and nothing bounds its unacknowledged "
            "bytes, so the kernel keeps retransmitting a request the gateway let go of (its "
            "timeout, its process killed or frozen) and a partition that heals delivers it "
            "late: after the next generation's writes (invariants 1, 2, 6), or, a re-send "
            "of the resolver, past the upstream's deduplication window (applied twice). "
            "Those need a partition to fall on a write in flight (killed on one run of "
            "four); invariant 16 sees the graceful close itself, at the upstream "
            "(let-go.jsonl), whenever the gateway lets go of a write in flight: its "
            "timeout on a slow answer, a shutdown. The bound on unacknowledged bytes (the "
            "other edit: a frozen process's retransmissions) is left to the fault test."
        ),
        fast=True,
        killed_by=(
            "tests/faults/test_partitioned_send.py::"
            "test_a_write_cut_off_never_reaches_the_upstream_after_the_gateway_let_go"
        ),
    ),
    Mutant(
        name="source-token-never-expires",
        rule="lease-source",
        databases=BOTH,
        edits=(
            Edit(
                "gateway/sources/signed.py",
                '            expires_at=float(claims["exp"]) + self.settings.leeway_seconds,',
                "            expires_at=None,",
            ),
        ),
        why=(
            "A signed token's exp is not passed to the admission (found by an independent "
            "review's mutant, issue 53), so an expired token writes on until a newer "
            "generation writes: the signed workers' lapse holdings (a token of 2 s, written "
            "with again past its exp, nothing newer signed meanwhile) break invariant 11."
        ),
        killed_by="tests/integration/test_source_jwt.py::test_expired_tokens_by_the_database_clock",
    ),
    Mutant(
        name="source-etcd-cache-forever",
        rule="lease-source",
        databases=BOTH,
        fast=True,
        run_args=("--etcd-lock-workers", "3"),
        edits=(
            Edit(
                "gateway/sources/etcd.py",
                "        if cached is not None and cached[0] > time.monotonic():",
                "        if cached is not None:",
            ),
        ),
        why=(
            "An etcd lock once read as held is believed "
            "until the cache evicts it instead of for cache_seconds, so a holder whose "
            "lease lapsed or was revoked writes on while nobody newer has written: the "
            "etcd lock workers' lapsing holdings (their own lock, left to lapse, then "
            "written with) break invariant 11."
        ),
        killed_by=(
            "tests/integration/test_source_etcd.py::"
            "test_a_lock_read_as_held_is_believed_only_for_cache_seconds"
        ),
    ),
    Mutant(
        name="source-zookeeper-held-remembered",
        rule="lease-source",
        databases=BOTH,
        run_args=("--zk-lock-workers", "3"),
        edits=(
            Edit(
                _ZOOKEEPER,
                "        self.client: KazooClient | None = None\n",
                "        self.client: KazooClient | None = None\n"
                "        self.held: dict[str, ExternalLease] = {}\n",
            ),
            Edit(
                _ZOOKEEPER,
                "        job_id = namespaced(self.name, path)\n"
                "        if job_id is None:\n"
                "            return None\n",
                "        job_id = namespaced(self.name, path)\n"
                "        if job_id is None:\n"
                "            return None\n"
                "        if token in self.held:\n"
                "            return self.held[token]\n",
            ),
            Edit(
                _ZOOKEEPER,
                "                return ExternalLease(\n"
                "                    self.name,\n"
                "                    job_id,\n"
                "                    int(stat.czxid),",
                "                self.held[token] = ExternalLease(\n"
                "                    self.name,\n"
                "                    job_id,\n"
                "                    int(stat.czxid),",
            ),
            Edit(
                _ZOOKEEPER,
                "                    reissued=COUNTER_LOST,\n"
                "                )\n"
                "            # Present, not the lowest",
                "                    reissued=COUNTER_LOST,\n"
                "                )\n"
                "                return self.held[token]\n"
                "            # Present, not the lowest",
            ),
        ),
        why=(
            "A ZooKeeper lock once read as held is remembered and believed ever after (a "
            "cache of held locks, as etcd's source has, without its cache_seconds), so a "
            "holder whose session expired or whose node was released writes on while "
            "nobody newer has written: the ZooKeeper lock workers' lapsing holdings (their "
            "own lock, its node released or its session lost, then written with) break "
            "invariant 11."
        ),
        killed_by=(
            "tests/integration/test_source_zookeeper.py::test_two_workers_take_the_lock_in_turn"
        ),
    ),
    # Hidden mutants (issue 53's independent review, 2026-12-07): written against main
    # without reading which workloads reach which spot; each a spot no mutant above
    # touches. docs/verification.md has their runs.
    Mutant(
        name="hidden-renew-from-old-expiry",
        rule="expiry",
        databases=BOTH,
        edits=(
            Edit(
                _COMMON,
                "    lease_expires_at = {now} + COALESCE(:ttl, lease_ttl_seconds),\n"
                "    claimable_at = {now} + COALESCE(:ttl, lease_ttl_seconds),\n",
                "    lease_expires_at = lease_expires_at + COALESCE(:ttl, lease_ttl_seconds),\n"
                "    claimable_at = claimable_at + COALESCE(:ttl, lease_ttl_seconds),\n",
            ),
            Edit(
                _POSTGRES,
                "        lease_expires_at = {now} + COALESCE(w.ttl, jobs.lease_ttl_seconds),\n"
                "        claimable_at = {now} + COALESCE(w.ttl, jobs.lease_ttl_seconds),\n",
                "        lease_expires_at = jobs.lease_expires_at"
                " + COALESCE(w.ttl, jobs.lease_ttl_seconds),\n"
                "        claimable_at = jobs.claimable_at"
                " + COALESCE(w.ttl, jobs.lease_ttl_seconds),\n",
            ),
        ),
        why=(
            "A renewal extends the lease by its TTL from its previous expiry instead of "
            "from now (both dialects' renew), so a lease renewed at a third of its TTL "
            "holds two thirds of a TTL longer than its holder was told, and more at each "
            "renewal: a holder that stopped renewing (a lapse, a paused worker) still "
            "writes after the lease it was granted has ended, with nobody newer granted "
            "(invariant 11)."
        ),
        killed_by=(
            "tests/integration/test_lease_api.py"
            "::test_renew_extends_the_lease_without_giving_out_the_token"
        ),
    ),
    Mutant(
        name="hidden-cancelled-send-released",
        rule="unknown-outcomes",
        databases=BOTH,
        edits=(
            Edit(
                "gateway/upstream/forwarding.py",
                "            if not began:\n"
                "                await asyncio.shield(end.ended(Exchange.NOT_SENT))\n",
                "            await asyncio.shield(end.ended(Exchange.NOT_SENT))\n",
            ),
        ),
        why=(
            "A forward cancelled (a shutdown past its grace) gives its key back as never "
            "sent whether or not its bytes had left, so a write the upstream received, "
            "and applied, while the gateway waited for its answer loses its record instead "
            "of turning unknown at its deadline, and the next generation's retry of the "
            "step is forwarded again: applied twice (invariants 3, 4), under the shutdown "
            "nemesis, whose slow answers keep writes in flight at the SIGTERM (under all on "
            "PostgreSQL only where a seed draws enough shutdowns; --nemesis shutdown kills "
            "it). Its test's older write ('old-step') is such a write, and its key must stay."
        ),
        killed_by=(
            "tests/integration/test_truthful_answers.py"
            "::test_a_shutdown_answers_a_waiting_write_never_sent_and_frees_its_key"
        ),
    ),
    Mutant(
        name="hidden-replay-one-piece-behind",
        rule="duplicates",
        databases=BOTH,
        edits=(
            Edit(
                "gateway/upstream/forwarding.py",
                "                            stored += chunk\n",
                "                            stored += held\n",
            ),
        ),
        why=(
            "The answer kept for replays is built from the pieces already relayed to the "
            "client (the held-back piece, one behind) instead of the pieces received, so "
            "the last piece is never kept: an answer that came in one piece is stored "
            "empty, and every replay (a retry, the next generation repeating a step) "
            "answers 2xx with a body other than the first answer's (invariant 5)."
        ),
        killed_by=(
            "tests/integration/test_gateway_idempotency.py::test_replay_gives_the_stored_answer"
        ),
    ),
    Mutant(
        name="hidden-acquire-any-owner",
        rule="expiry",
        databases=BOTH,
        edits=(
            Edit(
                "lease_core/sql/sqlite.sql",
                "       OR (state = {State.LEASED} AND owner = :owner))\n",
                "       OR (state = {State.LEASED} AND owner = owner))\n",
            ),
            Edit(
                _POSTGRES,
                "           OR (state = {State.LEASED} AND owner = :owner))\n",
                "           OR (state = {State.LEASED} AND owner = owner))\n",
            ),
        ),
        why=(
            "The acquire of a named job compares the owner column with itself (a colon "
            "dropped from :owner), so its same-owner clause holds for every leased job: "
            "anyone who acquires a job by name takes it from a current holder at once, a "
            "new generation while the old lease is current (invariant 15; the gateway "
            "still fences the old holder off). Reached by the solo rounds, whose second "
            "process asks for the job by name while the first lease is current (it survived "
            "every run before they did: no other workload acquires a job another owner "
            "holds)."
        ),
        killed_by="tests/integration/test_lease_api.py::test_acquire_of_a_held_job_is_409",
    ),
)


def apply(mutant: Mutant, root: Path) -> None:
    """Apply every edit to the tree at root; MutationError if an ``old`` text does not
    occur exactly once. Every edit is checked before any file is written, so a mutant
    that cannot be applied leaves the tree as it was; a ``pending`` mutant is refused."""
    if mutant.pending:
        raise MutationError(f"{mutant.name}: pending ({mutant.pending}): its text is not in")
    texts: dict[Path, str] = {}
    for edit in mutant.edits:
        path = root / edit.path
        if path not in texts:
            try:
                texts[path] = path.read_text(encoding="utf-8")
            except OSError as error:
                raise MutationError(f"{mutant.name}: cannot read {edit.path}: {error}") from error
        count = texts[path].count(edit.old)
        if count != 1:
            raise MutationError(
                f"{mutant.name}: {edit.path}: the text to replace occurs {count} times, "
                f"not once: {edit.old!r}"
            )
        texts[path] = texts[path].replace(edit.old, edit.new)
    for path, text in texts.items():
        path.write_text(text, encoding="utf-8")


def by_name(names: Iterable[str]) -> list[Mutant]:
    """The mutants named, in the order given; MutationError on an unknown name, listing
    the known ones."""
    known = {mutant.name: mutant for mutant in MUTANTS}
    chosen = []
    for name in names:
        if name not in known:
            raise MutationError(f"no mutant named {name!r}; known: {', '.join(known)}")
        chosen.append(known[name])
    return chosen
