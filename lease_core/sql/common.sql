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

-- fragment: lease_current
-- The job row's lease is current: leased, and not expired at {now}. (The batches of
-- postgresql.sql write it for their own aliases: admit (many) of job at clock.now,
-- renew (many) of jobs.)
state = {State.LEASED} AND lease_expires_at > {now}

-- fragment: token_lease_current
-- The job row's lease is :token_hash's, and current.
lease_token_hash = :token_hash AND {lease_current}

-- fragment: lease_expired
-- The job row's lease has expired at {now}: its job can be leased again.
state = {State.LEASED} AND lease_expires_at <= {now}

-- fragment: unknown_or_overdue
-- The record's outcome is unknown: said so, or in flight past its deadline at {now}.
-- (postgresql.sql: r_unknown_or_overdue, of the record r at clock.now.)
(state = {RecordState.UNKNOWN}
     OR (state = {RecordState.IN_FLIGHT} AND deadline <= {now}))

-- fragment: lease_older_in_flight
-- A write of a generation older than the lease l's to its job is still in flight at
-- clock.now (writes_in_flight: a row per record in flight).
EXISTS (
    SELECT 1 FROM writes_in_flight AS o
    WHERE o.job_id = l.job_id AND o.generation < l.generation AND o.deadline > clock.now
)

-- fragment: external_older_in_flight
-- A write of a generation older than :generation to the job :job_id (of another lease
-- source) is still in flight at {now}.
EXISTS (
    SELECT 1 FROM writes_in_flight AS o
    WHERE o.job_id = CAST(:job_id AS text)
      AND o.generation < CAST(:generation AS bigint) AND o.deadline > {now}
)

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

-- name: grant_slice_end
-- Read only: where a slice of :batch grants after :since ends, in order of expiry (the
-- expiry of the next grant after them); NULL when no more than :batch are left.
SELECT (
    SELECT expires_at FROM leases WHERE expires_at > :since
    ORDER BY expires_at LIMIT 1 OFFSET :batch
) AS slice_end;

-- name: lease_refusal
-- Read only: the grant behind a token and its job now, to say why the token's lease is
-- not current (lease_core.rules.refusal_reason). No row: no such token.
SELECT l.job_id, l.generation AS lease_generation, j.state, j.generation,
       j.lease_expires_at, {now} AS now
FROM leases AS l LEFT JOIN jobs AS j ON j.job_id = l.job_id
WHERE l.token_hash = :token_hash;

-- name: lease_of_token
-- Read only: the lease behind a token, its job, the job's fence and whether an older
-- generation's write to the job is still in flight; always one row (job_id NULL: no
-- such token; state NULL: the job has been purged since).
SELECT clock.now, l.job_id, l.generation AS lease_generation, l.owner AS lease_owner,
       j.state, j.generation, j.owner, j.lease_expires_at, j.attempts, j.max_attempts,
       f.generation AS fence_generation,
       {lease_older_in_flight} AS older_in_flight
FROM (SELECT {now} AS now) AS clock
LEFT JOIN leases AS l ON l.token_hash = :token_hash
LEFT JOIN jobs AS j ON j.job_id = l.job_id
LEFT JOIN fences AS f ON f.job_id = l.job_id;

-- name: external_lease
-- Read only: the fence of a job of another lease source (gateway.sources; its id
-- namespaced "<source>/<job>") and whether an older generation's write to it is still
-- in flight; always one row (fence_generation NULL: nothing of it has written yet).
SELECT {now} AS now, f.generation AS fence_generation,
       {external_older_in_flight} AS older_in_flight
FROM (SELECT 1 AS one) AS one
LEFT JOIN fences AS f ON f.job_id = CAST(:job_id AS text);

-- name: admit_external
-- A fenced write under a lease of another source (gateway.sources: an etcd lock, a
-- signed token), whose job (namespaced "<source>/<job>") and generation the source
-- vouched for. The job's fence is raised to this generation when it is not above it
-- and the lease is not past :expires_at (NULL: the source judged its expiry); the fence
-- row stays locked to the end of the transaction, so the admissions of one job are one
-- at a time, as the job row's lock makes them for the gateway's own leases. admitted
-- NULL: refused (fence_generation above the generation: stale; else expired). Then, as
-- in admit: the fence, the key's record as it was before, whether an older
-- generation's write is in flight, and the key claimed for this attempt, or its record
-- taken over when its outcome is unknown and the upstream's policy is retry (:retry).
-- A generation names one holder: the fence row keeps the holder (:holder, a digest) of
-- its generation, bound by the first admission of that generation; another holder
-- presenting the same generation is refused (the source issued it twice: its counter
-- was lost). A row from before the holder was kept (NULL) is bound by its next one.
INSERT INTO fences (job_id, generation, holder, updated_at)
SELECT CAST(:job_id AS text), CAST(:generation AS bigint), CAST(:holder AS text), {now}
WHERE CAST(:expires_at AS double precision) IS NULL
   OR CAST(:expires_at AS double precision) > {now}
ON CONFLICT (job_id) DO UPDATE
    SET generation = excluded.generation, holder = excluded.holder,
        updated_at = excluded.updated_at
    WHERE fences.generation < excluded.generation
       OR (fences.generation = excluded.generation
           AND COALESCE(fences.holder, excluded.holder) = excluded.holder)
RETURNING generation AS admitted;
SELECT {now} AS now, f.generation AS fence_generation, f.holder AS fence_holder,
       {external_older_in_flight} AS older_in_flight,
       r.fingerprint, r.state AS r_state, r.generation AS r_generation,
       r.attempt AS r_attempt, r.deadline, r.status, r.headers, r.body
FROM (SELECT 1 AS one) AS one
LEFT JOIN fences AS f ON f.job_id = CAST(:job_id AS text)
LEFT JOIN idempotency_records AS r
    ON r.job_id = CAST(:job_id AS text) AND r.key = CAST(:key AS text);
INSERT INTO idempotency_records (job_id, key, fingerprint, state, generation, attempt,
                                 upstream, method, path, deadline, created_at, updated_at)
SELECT CAST(:job_id AS text), CAST(:key AS text), CAST(:fingerprint AS text),
       {RecordState.IN_FLIGHT}, CAST(:generation AS bigint), CAST(:attempt AS text),
       CAST(:upstream AS text), CAST(:method AS text), CAST(:path AS text),
       {now} + CAST(:deadline_in AS double precision), {now}, {now}
WHERE CAST(:admitted AS bigint) IS NOT NULL
ON CONFLICT (job_id, key) DO NOTHING
RETURNING 1 AS claimed;
UPDATE idempotency_records
SET state = {RecordState.IN_FLIGHT}, generation = CAST(:generation AS bigint),
    attempt = CAST(:attempt AS text),
    deadline = {now} + CAST(:deadline_in AS double precision), updated_at = {now},
    unknown_at = NULL
WHERE job_id = CAST(:job_id AS text) AND key = CAST(:key AS text)
  AND CAST(:admitted AS bigint) IS NOT NULL AND CAST(:retry AS boolean)
  AND fingerprint = CAST(:fingerprint AS text)
  AND {unknown_or_overdue}
RETURNING 1 AS taken;
INSERT INTO writes_in_flight (job_id, key, generation, attempt, deadline)
SELECT job_id, key, generation, attempt, deadline FROM idempotency_records
WHERE job_id = CAST(:job_id AS text) AND key = CAST(:key AS text)
  AND attempt = CAST(:attempt AS text)
{mark_in_flight};

-- name: record
-- Read only: a key's record (an admission that found it claimed by a concurrent one
-- after its snapshot was taken reads it here).
SELECT fingerprint, state, generation, attempt, deadline, status, headers, body
FROM idempotency_records WHERE job_id = :job_id AND key = :key;

-- name: older_in_flight
-- Read only: whether a write of an older generation of the job is still in flight.
SELECT EXISTS (
    SELECT 1 FROM writes_in_flight
    WHERE job_id = :job_id AND generation < :generation AND deadline > {now}
) AS older_in_flight;

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
  AND {unknown_or_overdue}
RETURNING 1 AS changed;
DELETE FROM writes_in_flight
WHERE job_id = :job_id AND key = :key AND CAST(:changed AS integer) IS NOT NULL;

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
