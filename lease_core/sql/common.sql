-- The operations whose SQL is the same on every dialect (lease_core/catalogue.py loads
-- this file with each dialect's own, postgresql.sql or sqlite.sql; an operation lives in
-- exactly one of them). The format is explained at the top of postgresql.sql.
--
-- The rules first: a fragment ("-- fragment: <name>", used as "{name}") says once what
-- several statements test or set. One written here is the same on every dialect; one a
-- single dialect's statements use, or that each dialect writes its own way, goes in that
-- dialect's file. Every fragment defined is used, and the name says what the rule
-- tells, not where it is used.


-- ---------------------------------------------------------------------------------------
-- Rules
-- ---------------------------------------------------------------------------------------

-- fragment: lease_current(job)
-- The job row {job}'s lease is current: leased, and not expired at {now}. Every check
-- that a lease is current is this one.
{job}.state = {State.LEASED} AND {job}.lease_expires_at > {now}

-- fragment: lease_expired(job)
-- The job row {job}'s lease has expired at {now} (the leased rows that lease_current is
-- not): its job can be leased again.
{job}.state = {State.LEASED} AND {job}.lease_expires_at <= {now}

-- fragment: claimable(job)
-- The job row {job} may be claimed from its queue at {now}: due (pending past its retry
-- delay, or leased past its lease: claimable_at says when) and with attempts left. Every
-- claim from a queue tests this one.
{job}.claimable_at IS NOT NULL AND {job}.claimable_at <= {now}
    AND {job}.attempts < {job}.max_attempts

-- fragment: token_lease_current
-- The job row's lease (of UPDATE jobs) is :token_hash's, and current.
lease_token_hash = :token_hash AND {lease_current(jobs)}

-- fragment: past_deadline(row)
-- The deadline of {row} (a record in flight, or its marker in writes_in_flight) has
-- passed at {now}: nobody waits for that write any more, and its outcome is unknown.
-- Every check that a write's deadline has passed is this one.
{row}.deadline <= {now}

-- fragment: in_flight(row)
-- {row} (a record in flight, or its marker in writes_in_flight) is within its deadline
-- at {now} (the rows past_deadline is not): the write may still reach its upstream, and
-- a newer generation's write waits for it. Every check that a write is still in flight
-- is this one.
{row}.deadline > {now}

-- fragment: unknown_or_overdue(r)
-- The record {r}'s outcome is unknown: said so, or in flight past its deadline.
({r}.state = {RecordState.UNKNOWN}
     OR ({r}.state = {RecordState.IN_FLIGHT} AND {past_deadline({r})}))

-- fragment: lease_refusal(grant, job)
-- The verdict on the lease of the grant {grant} (a row of leases; NULL: no such token)
-- at {now}, its job {job} as it is now (NULL: purged since): NULL when it may write (the
-- job's generation and owner are the grant's, and its lease is current), else why not,
-- a reason of fencegate_client.reasons, in the order of refusal_reason in
-- tests/lease_model.py (the model the tests hold it to): a newer generation, or the job
-- gone, is stale; then an ended lease; then an expired one. The lease API's refusals are
-- this verdict too (the operation lease_refusal).
CASE
    WHEN {grant}.job_id IS NULL THEN {Reason.INVALID_FENCING_TOKEN}
    WHEN {job}.generation = {grant}.generation AND {job}.owner = {grant}.owner
         AND {lease_current({job})} THEN NULL
    WHEN {job}.job_id IS NULL OR {job}.generation > {grant}.generation
        THEN {Reason.STALE_GENERATION}
    WHEN {job}.state <> {State.LEASED} THEN {Reason.LEASE_ENDED}
    WHEN {lease_expired({job})} THEN {Reason.LEASE_EXPIRED}
    ELSE {Reason.STALE_GENERATION}
END

-- fragment: lease_older_in_flight(grant)
-- A write of a generation older than the grant {grant}'s (a row of leases) to its job
-- is still in flight (writes_in_flight: a row per record in flight).
EXISTS (
    SELECT 1 FROM writes_in_flight AS o
    WHERE o.job_id = {grant}.job_id AND o.generation < {grant}.generation AND {in_flight(o)}
)

-- fragment: external_older_in_flight
-- A write of a generation older than :generation to the job :job_id (of another lease
-- source) is still in flight.
EXISTS (
    SELECT 1 FROM writes_in_flight AS o
    WHERE o.job_id = CAST(:job_id AS text)
      AND o.generation < CAST(:generation AS bigint) AND {in_flight(o)}
)

-- fragment: external_stale(f)
-- The fence row {f} of a job of another lease source is above :generation: a newer
-- generation has been admitted, whatever the source says.
{f}.generation > CAST(:generation AS bigint)

-- fragment: token_expired
-- The expiry that a lease of another source carries (:expires_at, a signed token's;
-- NULL: the source judged the expiry itself) has passed at {now}.
(CAST(:expires_at AS double precision) IS NOT NULL
     AND CAST(:expires_at AS double precision) <= {now})

-- fragment: raise_fence
-- An admission's upsert of its job's fence (INSERT INTO fences ... ON CONFLICT): raised
-- to the lease's generation, never lowered, and not written again for an equal one.
ON CONFLICT (job_id) DO UPDATE
    SET generation = excluded.generation, updated_at = excluded.updated_at
    WHERE fences.generation < excluded.generation

-- fragment: mark_in_flight
-- The upsert into writes_in_flight (INSERT INTO writes_in_flight ... SELECT the record's
-- job_id, key, generation, attempt, deadline) that marks a record just put in flight,
-- claimed or taken over: a marker left by an earlier attempt of it (in flight past its
-- deadline) becomes this attempt's.
ON CONFLICT (job_id, key) DO UPDATE
    SET generation = excluded.generation, attempt = excluded.attempt,
        deadline = excluded.deadline

-- fragment: unmark_attempt
-- Take the record :key of :job_id out of writes_in_flight, while the marker is our
-- attempt's (:attempt): one that another attempt has taken over since is left alone.
DELETE FROM writes_in_flight WHERE job_id = :job_id AND key = :key AND attempt = :attempt

-- fragment: claim_key
-- The key :key of the job :job_id claimed for this attempt (:attempt) by an admission of
-- generation :admitted (NULL: not admitted, nothing is claimed): a record in flight until
-- {now} + :deadline_in, unless the key has a record already (claimed: 1 when this claimed
-- it). The claim of every admission (admit on SQLite, admit_external; PostgreSQL's admit
-- is one statement for a batch of callers and claims in its CTE "claim").
INSERT INTO idempotency_records (job_id, key, fingerprint, state, generation, attempt,
                                 upstream, method, path, deadline, created_at, updated_at)
SELECT CAST(:job_id AS text), CAST(:key AS text), CAST(:fingerprint AS text),
       {RecordState.IN_FLIGHT}, CAST(:admitted AS bigint), CAST(:attempt AS text),
       CAST(:upstream AS text), CAST(:method AS text), CAST(:path AS text),
       {now} + CAST(:deadline_in AS double precision), {now}, {now}
WHERE CAST(:admitted AS bigint) IS NOT NULL
ON CONFLICT (job_id, key) DO NOTHING
RETURNING 1 AS claimed

-- fragment: take_over_key
-- The key's record taken over for this attempt by an admission of generation :admitted,
-- when the record is the same request's (:fingerprint), its outcome unknown or overdue,
-- and the upstream's policy is retry (:retry): in flight again until {now} +
-- :deadline_in (taken: 1 when it was). A record this admission just claimed is in flight
-- and within its deadline, so it is not taken over as well.
UPDATE idempotency_records
SET state = {RecordState.IN_FLIGHT}, generation = CAST(:admitted AS bigint),
    attempt = CAST(:attempt AS text),
    deadline = {now} + CAST(:deadline_in AS double precision), updated_at = {now},
    unknown_at = NULL
WHERE job_id = CAST(:job_id AS text) AND key = CAST(:key AS text)
  AND CAST(:admitted AS bigint) IS NOT NULL AND CAST(:retry AS boolean)
  AND fingerprint = CAST(:fingerprint AS text)
  AND {unknown_or_overdue(idempotency_records)}
RETURNING 1 AS taken

-- fragment: mark_attempt
-- The key's record marked in writes_in_flight when it is this attempt's (claimed or
-- taken over just now; another attempt's record is left alone).
INSERT INTO writes_in_flight (job_id, key, generation, attempt, deadline)
SELECT job_id, key, generation, attempt, deadline FROM idempotency_records
WHERE job_id = CAST(:job_id AS text) AND key = CAST(:key AS text)
  AND attempt = CAST(:attempt AS text)
{mark_in_flight}

-- fragment: unknown_since
-- The unknown_at of a record that settles in the state :state at {now}: since now when
-- its outcome is unknown, NULL otherwise (a record settled in flight was NULL, so a
-- settle with an answer leaves the indexed column as it was).
CASE WHEN CAST(:state AS varchar(16)) = {RecordState.UNKNOWN} THEN {now} END


-- ---------------------------------------------------------------------------------------
-- Operations
-- ---------------------------------------------------------------------------------------

-- name: fail
-- The current lease fails its job: back to pending after :retry_in seconds, or failed
-- when it has no attempts left. No row: the lease is not current.
UPDATE jobs SET
    state = CASE WHEN attempts >= max_attempts THEN {State.FAILED} ELSE {State.PENDING} END,
    claimable_at = CASE WHEN attempts >= max_attempts THEN NULL ELSE {now} + :retry_in END,
    error = :error, lease_token_hash = NULL, lease_expires_at = NULL, updated_at = {now}
WHERE {token_lease_current}
RETURNING job_id, queue, state, generation, owner, lease_expires_at, attempts,
          max_attempts, payload, result, error, created_at;

-- name: renew
-- Extend the current lease (by its ttl, or a new one). No row: the lease is not current.
UPDATE jobs SET
    lease_ttl_seconds = COALESCE(:ttl, lease_ttl_seconds),
    lease_expires_at = {now} + COALESCE(:ttl, lease_ttl_seconds),
    claimable_at = {now} + COALESCE(:ttl, lease_ttl_seconds),
    updated_at = {now}
WHERE {token_lease_current}
RETURNING job_id, generation, owner, lease_expires_at, lease_ttl_seconds, payload;

-- name: complete
-- The current lease completes its job (its result: result_json). No row: the lease is
-- not current.
UPDATE jobs SET
    state = {State.COMPLETED}, result = {result_json}, lease_token_hash = NULL,
    lease_expires_at = NULL, claimable_at = NULL, updated_at = {now}
WHERE {token_lease_current}
RETURNING job_id, queue, state, generation, owner, lease_expires_at, attempts,
          max_attempts, payload, result, error, created_at;

-- name: release
-- The current lease gives its job back at once, without using up an attempt. No row:
-- the lease is not current.
UPDATE jobs SET
    state = {State.PENDING}, claimable_at = {now},
    attempts = CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END,
    lease_token_hash = NULL, lease_expires_at = NULL, updated_at = {now}
WHERE {token_lease_current}
RETURNING job_id, queue, state, generation, owner, lease_expires_at, attempts,
          max_attempts, payload, result, error, created_at;

-- name: grant_slice_end
-- Read only: where a slice of :batch grants after :since ends, in order of expiry (the
-- expiry of the next grant after them); NULL when no more than :batch are left.
SELECT (
    SELECT expires_at FROM leases WHERE expires_at > :since
    ORDER BY expires_at LIMIT 1 OFFSET :batch
) AS slice_end;

-- name: lease_refusal
-- Read only: why the token's lease is not current, the verdict of the one rule
-- (lease_refusal; NULL: current again, which a lease never becomes once it was not: the
-- caller then says stale). No row: no such token.
SELECT l.job_id, {lease_refusal(l, j)} AS refusal
FROM leases AS l LEFT JOIN jobs AS j ON j.job_id = l.job_id
WHERE l.token_hash = :token_hash;

-- name: lease_of_token
-- Read only: the lease behind a token, its job, the job's fence and whether an older
-- generation's write to the job is still in flight; always one row (job_id NULL: no
-- such token; state NULL: the job has been purged since); refusal: the verdict on the
-- lease (lease_refusal; NULL: it may write now).
SELECT clock.now, l.job_id, l.generation AS lease_generation, l.owner AS lease_owner,
       j.state, j.generation, j.owner, j.lease_expires_at, j.attempts, j.max_attempts,
       f.generation AS fence_generation,
       {lease_older_in_flight(l)} AS older_in_flight,
       {lease_refusal(l, j)} AS refusal
FROM (SELECT {now} AS now) AS clock
LEFT JOIN leases AS l ON l.token_hash = :token_hash
LEFT JOIN jobs AS j ON j.job_id = l.job_id
LEFT JOIN fences AS f ON f.job_id = l.job_id;

-- name: external_lease
-- Read only: the fence of a job of another lease source (gateway.sources; its id
-- namespaced "<source>/<job>"), whether an older generation's write to it is still in
-- flight, and the verdict on the lease (refusal; NULL: it may write now), in the spec's
-- order: a generation below the fence is stale whatever the source says; then the
-- source's own finding (:lost, the reason it names; NULL: none); then the expiry the
-- lease carries (:expires_at), by the database's clock. Always one row
-- (fence_generation NULL: nothing of it has written yet). This read only refuses early
-- (before the body is read) with what it sees; admit_external decides, on its locked
-- fence row, and only it judges a generation bound to another holder (reissued): the
-- two verdicts share their rules (external_stale, token_expired), not their questions.
SELECT {now} AS now, f.generation AS fence_generation,
       {external_older_in_flight} AS older_in_flight,
       CASE
           WHEN {external_stale(f)} THEN {Reason.STALE_GENERATION}
           WHEN CAST(:lost AS text) IS NOT NULL THEN CAST(:lost AS text)
           WHEN {token_expired} THEN {Reason.LEASE_EXPIRED}
       END AS refusal
FROM (SELECT 1 AS one) AS one
LEFT JOIN fences AS f ON f.job_id = CAST(:job_id AS text);

-- name: admit_external
-- A fenced write under a lease of another source (gateway.sources: an etcd lock, a
-- signed token), whose job (namespaced "<source>/<job>") and generation the source
-- vouched for. The job's fence is raised to this generation when it is not above it
-- and the lease is not past :expires_at (NULL: the source judged its expiry); the fence
-- row stays locked to the end of the transaction, so the admissions of one job are one
-- at a time, as the job row's lock makes them for the gateway's own leases. admitted
-- NULL: refused, and refusal says why, read from that locked row (above the
-- generation: stale; the same generation bound to another holder: reissued; past
-- :expires_at: expired; nothing else refuses, so stale when none shows). Then, as
-- in admit: the fence, the key's record as it was before, whether an older
-- generation's write is in flight, and the key claimed for this attempt, or its record
-- taken over when its outcome is unknown and the upstream's policy is retry (:retry).
-- A generation names one holder: the fence row keeps the holder (:holder, a digest) of
-- its generation, bound by the first admission of that generation; another holder
-- presenting the same generation is refused (the source issued it twice: its counter
-- was lost). A row from before the holder was kept (NULL) is bound by its next one.
INSERT INTO fences (job_id, generation, holder, updated_at)
SELECT CAST(:job_id AS text), CAST(:generation AS bigint), CAST(:holder AS text), {now}
WHERE NOT {token_expired}
ON CONFLICT (job_id) DO UPDATE
    SET generation = excluded.generation, holder = excluded.holder,
        updated_at = excluded.updated_at
    WHERE fences.generation < excluded.generation
       OR (fences.generation = excluded.generation
           AND COALESCE(fences.holder, excluded.holder) = excluded.holder)
RETURNING generation AS admitted;
SELECT {now} AS now, f.generation AS fence_generation, f.holder AS fence_holder,
       {external_older_in_flight} AS older_in_flight,
       CASE
           WHEN CAST(:admitted AS bigint) IS NOT NULL THEN NULL
           WHEN {external_stale(f)} THEN {Reason.STALE_GENERATION}
           WHEN f.generation = CAST(:generation AS bigint)
                AND f.holder <> CAST(:holder AS text) THEN {Reason.GENERATION_REISSUED}
           WHEN {token_expired} THEN {Reason.LEASE_EXPIRED}
           ELSE {Reason.STALE_GENERATION}
       END AS refusal,
       r.fingerprint, r.state AS r_state, r.generation AS r_generation,
       r.attempt AS r_attempt, r.deadline, {past_deadline(r)} AS overdue, r.status,
       r.headers, r.body
FROM (SELECT 1 AS one) AS one
LEFT JOIN fences AS f ON f.job_id = CAST(:job_id AS text)
LEFT JOIN idempotency_records AS r
    ON r.job_id = CAST(:job_id AS text) AND r.key = CAST(:key AS text);
{claim_key};
{take_over_key};
{mark_attempt};

-- name: record
-- Read only: a key's record (an admission that found it claimed by a concurrent one
-- after its snapshot was taken reads it here; a duplicate waiting for it looks here),
-- and whether its deadline has passed (overdue: an in-flight one's outcome is unknown).
SELECT r.fingerprint, r.state, r.generation, r.attempt, r.deadline,
       {past_deadline(r)} AS overdue, r.status, r.headers, r.body
FROM idempotency_records AS r WHERE r.job_id = :job_id AND r.key = :key;

-- name: lowest_in_flight
-- Read only: the lowest generation of the job's writes in flight (NULL: none; always one
-- row), through the primary key's job_id. A write of generation g waiting for older
-- generations' writes may go once it is not below g: one read answers every generation
-- of the job waiting on a replica (gateway.proxy.duplicates.Order).
SELECT MIN(o.generation) AS lowest
FROM writes_in_flight AS o
WHERE o.job_id = :job_id AND {in_flight(o)};

-- name: claim_state
-- Read only, right before a claimed write is sent: the job's fence; while the record is
-- still this attempt's and in flight, its deadline; and whether an older generation's
-- write to the job is in flight (one the admission's snapshot could not see: the
-- gateway's resolver may have claimed an older record since); always one row.
-- (postgresql.sql adds its form for many callers.)
SELECT clock.now, f.generation AS fence_generation, r.deadline,
       EXISTS (
           SELECT 1 FROM writes_in_flight AS o
           WHERE o.job_id = :job_id AND o.generation < r.generation AND {in_flight(o)}
       ) AS older_in_flight
FROM (SELECT {now} AS now) AS clock
LEFT JOIN fences AS f ON f.job_id = :job_id
LEFT JOIN idempotency_records AS r
    ON r.job_id = :job_id AND r.key = :key AND r.attempt = :attempt
   AND r.state = {RecordState.IN_FLIGHT};

-- name: release_claim
-- Our attempt never reached the upstream: undo its claim.
DELETE FROM idempotency_records WHERE job_id = :job_id AND key = :key AND attempt = :attempt;
{unmark_attempt};

-- name: return_claim
-- Our attempt at a record taken over never reached the upstream: the record goes back
-- to unknown, as the attempt it was taken from.
UPDATE idempotency_records
SET state = {RecordState.UNKNOWN}, attempt = :back_attempt, generation = :back_generation,
    updated_at = {now}, unknown_at = {now}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt;
{unmark_attempt};

-- name: resolve_not_applied
-- An operator says an unknown outcome was not applied: the record goes (with its
-- marker, in flight past its deadline), and the next request with this key is
-- forwarded. No row: not (or no longer) unknown.
DELETE FROM idempotency_records
WHERE job_id = :job_id AND key = :key
  AND {unknown_or_overdue(idempotency_records)}
RETURNING 1 AS changed;
DELETE FROM writes_in_flight
WHERE job_id = :job_id AND key = :key AND CAST(:changed AS integer) IS NOT NULL;

-- name: list_unknown (rows)
-- Read only: the keys whose outcome is unknown (said so, or in flight past the
-- deadline) and those the gateway is re-sending right now (in flight, within the
-- deadline, re-sent before: state "resolving"), the most recently changed first, :limit
-- of them; resolvable: the request is kept, so the gateway may re-send it. The keys
-- come from the unknown records' index and writes_in_flight: never a read of every
-- record. The unknown ones are a range of unknown_at bounded on both sides (by finite
-- numbers: SQLite reads 'Infinity' as 0): to a planner with no statistics "IS NOT NULL"
-- alone is nearly every record (a read of the table).
SELECT r.job_id, r.key,
       CASE WHEN r.state = {RecordState.IN_FLIGHT} AND {in_flight(r)} THEN 'resolving'
            ELSE {RecordState.UNKNOWN} END AS state,
       r.generation, r.upstream, r.method, r.path, r.status, r.note, r.resolve_attempts,
       r.request_body IS NOT NULL AS resolvable, r.updated_at
FROM (
    SELECT job_id, key FROM idempotency_records
    WHERE unknown_at >= -1e308 AND unknown_at <= 1e308
    UNION ALL
    SELECT w.job_id, w.key FROM writes_in_flight AS w
    JOIN idempotency_records AS x ON x.job_id = w.job_id AND x.key = w.key
    WHERE {past_deadline(w)} OR x.resolve_attempts > 0
) AS candidate
JOIN idempotency_records AS r ON r.job_id = candidate.job_id AND r.key = candidate.key
ORDER BY r.updated_at DESC
LIMIT :limit;

-- name: audit
-- One entry of a request with a lease behind it.
INSERT INTO audit_log (at, reason, status, job_id, generation, highest_generation, owner,
                       upstream, method, path, idempotency_key, client, fingerprint, body,
                       replica)
VALUES ({now}, :reason, :status, :job_id, :generation, :highest_generation, :owner,
        :upstream, :method, :path, :idempotency_key, :client, :fingerprint, :body, :replica);

-- name: audit_grouped
-- A request without a lease behind it, counted in its group's row (gateway.audit).
INSERT INTO audit_log (at, last_at, count, group_key, reason, status, job_id, generation,
                       highest_generation, owner, upstream, method, path, idempotency_key,
                       client, fingerprint, body, replica)
VALUES ({now}, {now}, 1, :group_key, :reason, :status, :job_id, :generation,
        :highest_generation, :owner, :upstream, :method, :path, :idempotency_key, :client,
        :fingerprint, NULL, :replica)
ON CONFLICT (group_key) DO UPDATE
    SET count = audit_log.count + 1, last_at = excluded.last_at;
