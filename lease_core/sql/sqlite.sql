-- Every state change of Fencegate on SQLite, by name (lease_core/catalogue.py); the same
-- operations as lease_core/sql/postgresql.sql, whose header explains the format.
--
-- An operation's statements run in one IMMEDIATE transaction (a savepoint of the group
-- transaction of lease_core.direct), which keeps every other writer out until it
-- commits: where PostgreSQL needs one statement or a row lock, SQLite runs several
-- statements, each of them conditional, so the SQL decides and the Python only reads
-- the answer. How many rows a statement changed: SELECT changes().


-- ---------------------------------------------------------------------------------------
-- Jobs and leases
-- ---------------------------------------------------------------------------------------

-- name: enqueue
-- A new pending job; a job created again after a purge continues above its last
-- generation (job_tombstones). No row: the id is taken.
INSERT INTO jobs (job_id, queue, state, generation, attempts, max_attempts, payload,
                  claimable_at, created_at, updated_at)
VALUES (:job_id, :queue, {State.PENDING},
        COALESCE((SELECT t.generation FROM job_tombstones AS t WHERE t.job_id = :job_id), 0),
        0, :max_attempts, :payload, {now}, {now}, {now})
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id, queue, state, generation, owner, lease_expires_at, attempts,
          max_attempts, payload, result, error, created_at;

-- name: acquire
-- A named job, created pending if absent, is leased when it is pending, its lease
-- expired, or the same owner holds it; the grant is recorded in leases. granted NULL:
-- refused, and found_state / found_expires_at say why.
INSERT INTO jobs (job_id, queue, state, generation, attempts, max_attempts, payload,
                  claimable_at, created_at, updated_at)
VALUES (:job_id, :queue, {State.PENDING},
        COALESCE((SELECT t.generation FROM job_tombstones AS t WHERE t.job_id = :job_id), 0),
        0, :max_attempts, :payload, {now}, {now}, {now})
ON CONFLICT (job_id) DO NOTHING;
SELECT state AS found_state, lease_expires_at AS found_expires_at
FROM jobs WHERE job_id = :job_id;
UPDATE jobs SET
    state = {State.LEASED}, generation = generation + 1, owner = :owner,
    lease_token_hash = :token_hash, lease_ttl_seconds = :ttl,
    lease_expires_at = {now} + :ttl, claimable_at = {now} + :ttl,
    attempts = attempts + 1, updated_at = {now}
WHERE job_id = :job_id
  AND (state = {State.PENDING}
       OR (state = {State.LEASED} AND (lease_expires_at <= {now} OR owner = :owner)))
RETURNING job_id, generation, owner, lease_expires_at, lease_ttl_seconds, payload,
          1 AS granted;
INSERT INTO leases (token_hash, job_id, generation, owner, granted_at, expires_at)
SELECT lease_token_hash, job_id, generation, owner, {now}, lease_expires_at
FROM jobs WHERE lease_token_hash = :token_hash;

-- name: claim
-- Lease the next claimable job of a queue (pending and due, or leased with an expired
-- lease, with attempts left), and record the grant.
UPDATE jobs SET
    state = {State.LEASED}, generation = generation + 1, owner = :owner,
    lease_token_hash = :token_hash, lease_ttl_seconds = :ttl,
    lease_expires_at = {now} + :ttl, claimable_at = {now} + :ttl,
    attempts = attempts + 1, updated_at = {now}
WHERE job_id = (
    SELECT job_id FROM jobs
    WHERE queue = :queue AND claimable_at IS NOT NULL AND claimable_at <= {now}
      AND attempts < max_attempts
    ORDER BY claimable_at LIMIT 1
)
RETURNING job_id, generation, owner, lease_expires_at, lease_ttl_seconds, payload;
INSERT INTO leases (token_hash, job_id, generation, owner, granted_at, expires_at)
SELECT lease_token_hash, job_id, generation, owner, {now}, lease_expires_at
FROM jobs WHERE lease_token_hash = :token_hash;

-- name: renew
-- Extend the current lease (by its ttl, or a new one). No row: the lease is not current.
UPDATE jobs SET
    lease_ttl_seconds = COALESCE(:ttl, lease_ttl_seconds),
    lease_expires_at = {now} + COALESCE(:ttl, lease_ttl_seconds),
    claimable_at = {now} + COALESCE(:ttl, lease_ttl_seconds),
    updated_at = {now}
WHERE lease_token_hash = :token_hash AND state = {State.LEASED} AND lease_expires_at > {now}
RETURNING job_id, generation, owner, lease_expires_at, lease_ttl_seconds, payload;

-- name: complete
-- The current lease completes its job. No row: the lease is not current.
UPDATE jobs SET
    state = {State.COMPLETED}, result = :result, lease_token_hash = NULL,
    lease_expires_at = NULL, claimable_at = NULL, updated_at = {now}
WHERE lease_token_hash = :token_hash AND state = {State.LEASED} AND lease_expires_at > {now}
RETURNING job_id, queue, state, generation, owner, lease_expires_at, attempts,
          max_attempts, payload, result, error, created_at;

-- name: fail
-- The current lease fails its job: back to pending after :retry_in seconds, or failed
-- when it has no attempts left. No row: the lease is not current.
UPDATE jobs SET
    state = CASE WHEN attempts >= max_attempts THEN {State.FAILED} ELSE {State.PENDING} END,
    claimable_at = CASE WHEN attempts >= max_attempts THEN NULL ELSE {now} + :retry_in END,
    error = :error, lease_token_hash = NULL, lease_expires_at = NULL, updated_at = {now}
WHERE lease_token_hash = :token_hash AND state = {State.LEASED} AND lease_expires_at > {now}
RETURNING job_id, queue, state, generation, owner, lease_expires_at, attempts,
          max_attempts, payload, result, error, created_at;

-- name: release
-- The current lease gives its job back at once, without using up an attempt. No row:
-- the lease is not current.
UPDATE jobs SET
    state = {State.PENDING}, claimable_at = {now}, attempts = MAX(attempts - 1, 0),
    lease_token_hash = NULL, lease_expires_at = NULL, updated_at = {now}
WHERE lease_token_hash = :token_hash AND state = {State.LEASED} AND lease_expires_at > {now}
RETURNING job_id, queue, state, generation, owner, lease_expires_at, attempts,
          max_attempts, payload, result, error, created_at;

-- name: lease_refusal
-- Read only: the grant behind a token and its job now, to say why the token's lease is
-- not current (lease_core.rules.refusal_reason). No row: no such token.
SELECT l.job_id, l.generation AS lease_generation, j.state, j.generation,
       j.lease_expires_at, {now} AS now
FROM leases AS l LEFT JOIN jobs AS j ON j.job_id = l.job_id
WHERE l.token_hash = :token_hash;

-- name: purge_job
-- Delete a job that no current lease holds and none of whose writes is in flight,
-- remember its last generation (job_tombstones), and drop the gateway's records of its
-- writes. found NULL: no such job; purged_generation NULL: refused (writing says
-- whether a write is in flight).
SELECT job_id AS found FROM jobs WHERE job_id = :job_id;
SELECT EXISTS (
    SELECT 1 FROM idempotency_records
    WHERE job_id = :job_id AND state = {RecordState.IN_FLIGHT} AND deadline > {now}
) AS writing;
DELETE FROM jobs
WHERE job_id = :job_id AND NOT :writing
  AND NOT (state = {State.LEASED} AND lease_expires_at > {now})
RETURNING generation AS purged_generation;
DELETE FROM idempotency_records
WHERE job_id = :job_id AND :purged_generation IS NOT NULL;
INSERT INTO job_tombstones (job_id, generation, purged_at)
SELECT :job_id, :purged_generation, {now}
WHERE :purged_generation IS NOT NULL
ON CONFLICT (job_id) DO UPDATE
    SET generation = excluded.generation, purged_at = excluded.purged_at;

-- name: fail_exhausted
-- Expired leases on their last attempt become failed; how many.
UPDATE jobs SET
    state = {State.FAILED}, error = 'the lease expired on the last attempt',
    lease_token_hash = NULL, claimable_at = NULL, lease_expires_at = NULL,
    updated_at = {now}
WHERE state = {State.LEASED} AND lease_expires_at <= {now} AND attempts >= max_attempts;
SELECT changes() AS changed;

-- name: purge_grants
-- Forget grants older than :older_than seconds; a job's current grant is always kept.
-- How many.
DELETE FROM leases
WHERE expires_at < {now} - :older_than
  AND NOT EXISTS (
      SELECT 1 FROM jobs AS j
      WHERE j.job_id = leases.job_id AND j.generation = leases.generation
  );
SELECT changes() AS changed;


-- ---------------------------------------------------------------------------------------
-- The gateway's writes
-- ---------------------------------------------------------------------------------------

-- name: lease_of_token
-- Read only: the lease behind a token, its job, the job's fence and whether an older
-- generation's write to the job is still in flight; always one row (job_id NULL: no
-- such token; state NULL: the job has been purged since).
SELECT clock.now, l.job_id, l.generation AS lease_generation, l.owner AS lease_owner,
       j.state, j.generation, j.owner, j.lease_expires_at, j.attempts, j.max_attempts,
       f.generation AS fence_generation,
       EXISTS (
           SELECT 1 FROM idempotency_records AS o
           WHERE o.job_id = l.job_id AND o.state = {RecordState.IN_FLIGHT}
             AND o.generation < l.generation AND o.deadline > clock.now
       ) AS older_in_flight
FROM (SELECT {now} AS now) AS clock
LEFT JOIN leases AS l ON l.token_hash = :token_hash
LEFT JOIN jobs AS j ON j.job_id = l.job_id
LEFT JOIN fences AS f ON f.job_id = l.job_id;

-- name: admit
-- A fenced write is admitted: the lease is current, the job's fence is raised to this
-- generation, the key is claimed for this attempt, or its record is read; a record of
-- the same request whose outcome is unknown (or in flight past its deadline) is taken
-- over when the upstream's policy is retry (:retry). The first statement reads the
-- lease, the fence, the older generations' writes and the key's record as they were
-- before; each later one is conditional on the lease being current.
SELECT clock.now, l.job_id, l.generation AS lease_generation, l.owner AS lease_owner,
       j.state, j.generation, j.owner, j.lease_expires_at, j.attempts, j.max_attempts,
       f.generation AS fence_generation,
       EXISTS (
           SELECT 1 FROM idempotency_records AS o
           WHERE o.job_id = l.job_id AND o.state = {RecordState.IN_FLIGHT}
             AND o.generation < l.generation AND o.deadline > clock.now
       ) AS older_in_flight,
       r.fingerprint, r.state AS r_state, r.generation AS r_generation,
       r.attempt AS r_attempt, r.deadline, r.status, r.headers, r.body
FROM (SELECT {now} AS now) AS clock
LEFT JOIN leases AS l ON l.token_hash = :token_hash
LEFT JOIN jobs AS j ON j.job_id = l.job_id
LEFT JOIN fences AS f ON f.job_id = l.job_id
LEFT JOIN idempotency_records AS r ON r.job_id = l.job_id AND r.key = :key;
INSERT INTO fences (job_id, generation, updated_at)
SELECT job_id, generation, {now} FROM jobs
WHERE lease_token_hash = :token_hash AND state = {State.LEASED} AND lease_expires_at > {now}
ON CONFLICT (job_id) DO UPDATE
    SET generation = excluded.generation, updated_at = excluded.updated_at
    WHERE fences.generation < excluded.generation;
INSERT INTO idempotency_records (job_id, key, fingerprint, state, generation, attempt,
                                 upstream, method, path, deadline, created_at, updated_at)
SELECT job_id, :key, :fingerprint, {RecordState.IN_FLIGHT}, generation, :attempt, :upstream,
       :method, :path, {now} + :deadline_in, {now}, {now}
FROM jobs
WHERE lease_token_hash = :token_hash AND state = {State.LEASED} AND lease_expires_at > {now}
ON CONFLICT (job_id, key) DO NOTHING
RETURNING 1 AS claimed;
UPDATE idempotency_records
SET state = {RecordState.IN_FLIGHT}, generation = j.generation, attempt = :attempt,
    deadline = {now} + :deadline_in, updated_at = {now}
FROM (
    SELECT job_id, generation FROM jobs
    WHERE lease_token_hash = :token_hash AND state = {State.LEASED}
      AND lease_expires_at > {now}
) AS j
WHERE idempotency_records.job_id = j.job_id AND idempotency_records.key = :key
  AND :retry AND idempotency_records.fingerprint = :fingerprint
  AND (idempotency_records.state = {RecordState.UNKNOWN}
       OR (idempotency_records.state = {RecordState.IN_FLIGHT}
           AND idempotency_records.deadline <= {now}))
RETURNING 1 AS taken;

-- name: external_lease
-- Read only: the fence of a job of another lease source (gateway.sources; its id
-- namespaced "<source>/<job>") and whether an older generation's write to it is still
-- in flight; always one row (fence_generation NULL: nothing of it has written yet).
SELECT {now} AS now, f.generation AS fence_generation,
       EXISTS (
           SELECT 1 FROM idempotency_records AS o
           WHERE o.job_id = CAST(:job_id AS text) AND o.state = {RecordState.IN_FLIGHT}
             AND o.generation < CAST(:generation AS bigint) AND o.deadline > {now}
       ) AS older_in_flight
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
INSERT INTO fences (job_id, generation, updated_at)
SELECT CAST(:job_id AS text), CAST(:generation AS bigint), {now}
WHERE CAST(:expires_at AS double precision) IS NULL
   OR CAST(:expires_at AS double precision) > {now}
ON CONFLICT (job_id) DO UPDATE
    SET generation = excluded.generation, updated_at = excluded.updated_at
    WHERE fences.generation <= excluded.generation
RETURNING generation AS admitted;
SELECT {now} AS now, f.generation AS fence_generation,
       EXISTS (
           SELECT 1 FROM idempotency_records AS o
           WHERE o.job_id = CAST(:job_id AS text) AND o.state = {RecordState.IN_FLIGHT}
             AND o.generation < CAST(:generation AS bigint) AND o.deadline > {now}
       ) AS older_in_flight,
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
    deadline = {now} + CAST(:deadline_in AS double precision), updated_at = {now}
WHERE job_id = CAST(:job_id AS text) AND key = CAST(:key AS text)
  AND CAST(:admitted AS bigint) IS NOT NULL AND CAST(:retry AS boolean)
  AND fingerprint = CAST(:fingerprint AS text)
  AND (state = {RecordState.UNKNOWN}
       OR (state = {RecordState.IN_FLIGHT} AND deadline <= {now}))
RETURNING 1 AS taken;

-- name: record
-- Read only: a key's record.
SELECT fingerprint, state, generation, attempt, deadline, status, headers, body
FROM idempotency_records WHERE job_id = :job_id AND key = :key;

-- name: claim_state
-- Read only, right before a claimed write is sent: the job's fence and, while the record
-- is still this attempt's and in flight, its deadline; always one row.
SELECT clock.now, f.generation AS fence_generation, r.deadline
FROM (SELECT {now} AS now) AS clock
LEFT JOIN fences AS f ON f.job_id = :job_id
LEFT JOIN idempotency_records AS r
    ON r.job_id = :job_id AND r.key = :key AND r.attempt = :attempt
   AND r.state = {RecordState.IN_FLIGHT};

-- name: older_in_flight
-- Read only: whether a write of an older generation of the job is still in flight.
SELECT EXISTS (
    SELECT 1 FROM idempotency_records
    WHERE job_id = :job_id AND state = {RecordState.IN_FLIGHT}
      AND generation < :generation AND deadline > {now}
) AS older_in_flight;

-- name: settle
-- Store the answer of our attempt (completed, or unknown outcome); a record another
-- attempt has taken over meanwhile is left alone.
UPDATE idempotency_records
SET state = :state, status = :status, headers = :headers, body = :body, note = :note,
    updated_at = {now}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt;

-- name: forget
-- A write without a key completed: its record (kept only for ordering) goes.
DELETE FROM idempotency_records WHERE job_id = :job_id AND key = :key AND attempt = :attempt;

-- name: release_claim
-- Our attempt never reached the upstream: undo its claim.
DELETE FROM idempotency_records WHERE job_id = :job_id AND key = :key AND attempt = :attempt;

-- name: return_claim
-- Our attempt at a record taken over never reached the upstream: the record goes back
-- to unknown, as the attempt it was taken from.
UPDATE idempotency_records
SET state = {RecordState.UNKNOWN}, attempt = :back_attempt, generation = :back_generation,
    updated_at = {now}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt;

-- name: hold_for_resolution
-- Our attempt's outcome is unknown and the gateway may resolve it itself (the upstream's
-- unknown_outcome is "resolve"): as settle, keeping the request as it was forwarded (its
-- query and headers without the configured secrets, its body) for the re-send.
UPDATE idempotency_records
SET state = {RecordState.UNKNOWN}, status = :status, headers = :headers, body = :body,
    note = :note, request_head = :request_head, request_body = :request_body,
    updated_at = {now}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt;

-- name: claim_resolution
-- Claim one unknown outcome of :upstream for a re-send by the gateway (gateway.resolve):
-- its request kept, first sent less than :window seconds ago, re-sent fewer than
-- :max_attempts times and not in the last :pause seconds, and no newer generation of its
-- job admitted (the fence not above its generation). It becomes in flight under
-- :attempt until :deadline_in from now, so a newer generation's write waits for it and a
-- worker's retry is told it is in progress; its re-sends are counted. The IMMEDIATE
-- transaction keeps every other writer out, so no two claims take one record. No row:
-- nothing to resolve now.
UPDATE idempotency_records
SET state = {RecordState.IN_FLIGHT}, attempt = :attempt, deadline = {now} + :deadline_in,
    resolve_attempts = resolve_attempts + 1, updated_at = {now}
WHERE (job_id, key) = (
    SELECT r.job_id, r.key
    FROM idempotency_records AS r
    JOIN fences AS f ON f.job_id = r.job_id AND f.generation <= r.generation
    WHERE r.upstream = :upstream
      AND (r.state = {RecordState.UNKNOWN}
           OR (r.state = {RecordState.IN_FLIGHT} AND r.deadline <= {now}))
      AND r.request_body IS NOT NULL
      AND r.created_at > {now} - :window
      AND r.resolve_attempts < :max_attempts
      AND r.updated_at <= {now} - :pause
    ORDER BY r.updated_at
    LIMIT 1
)
RETURNING job_id, key, generation, fingerprint, method, path, request_head, request_body,
          resolve_attempts;

-- name: settle_resolution
-- The end of a re-send by the gateway, while the record is still our attempt: its
-- answer (completed), or unknown again; the kept request stays only for another
-- re-send (:keep_request), else it goes. No row: the record is no longer ours.
UPDATE idempotency_records
SET state = :state, status = :status, headers = :headers, body = :body, note = :note,
    request_head = CASE WHEN :keep_request THEN request_head END,
    request_body = CASE WHEN :keep_request THEN request_body END,
    updated_at = {now}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt
RETURNING 1 AS changed;

-- name: resolve_applied
-- An operator says an unknown outcome was applied: later duplicates replay this answer.
-- No row: the key's outcome is not (or no longer) unknown.
UPDATE idempotency_records
SET state = {RecordState.COMPLETED}, status = :status, headers = :headers,
    body = :body, note = 'resolved by an operator: applied', updated_at = {now}
WHERE job_id = :job_id AND key = :key
  AND (state = {RecordState.UNKNOWN}
       OR (state = {RecordState.IN_FLIGHT} AND deadline <= {now}))
RETURNING 1 AS changed;

-- name: resolve_not_applied
-- An operator says an unknown outcome was not applied: the record goes, and the next
-- request with this key is forwarded. No row: not (or no longer) unknown.
DELETE FROM idempotency_records
WHERE job_id = :job_id AND key = :key
  AND (state = {RecordState.UNKNOWN}
       OR (state = {RecordState.IN_FLIGHT} AND deadline <= {now}))
RETURNING 1 AS changed;

-- name: purge_records
-- Completed records past retention; never an unknown or in-flight one. How many.
DELETE FROM idempotency_records
WHERE state = {RecordState.COMPLETED} AND updated_at < {now} - :older_than;
SELECT changes() AS changed;


-- ---------------------------------------------------------------------------------------
-- The audit
-- ---------------------------------------------------------------------------------------

-- name: audit
-- One entry of a request with a lease behind it.
INSERT INTO audit_log (at, reason, status, job_id, generation, highest_generation, owner,
                       upstream, method, path, idempotency_key, client, fingerprint, body)
VALUES ({now}, :reason, :status, :job_id, :generation, :highest_generation, :owner,
        :upstream, :method, :path, :idempotency_key, :client, :fingerprint, :body);

-- name: audit_grouped
-- A request without a lease behind it, counted in its group's row (gateway.audit).
INSERT INTO audit_log (at, last_at, count, group_key, reason, status, job_id, generation,
                       highest_generation, owner, upstream, method, path, idempotency_key,
                       client, fingerprint, body)
VALUES ({now}, {now}, 1, :group_key, :reason, :status, :job_id, :generation,
        :highest_generation, :owner, :upstream, :method, :path, :idempotency_key, :client,
        :fingerprint, NULL)
ON CONFLICT (group_key) DO UPDATE
    SET count = audit_log.count + 1, last_at = excluded.last_at;

-- name: purge_audit
-- Entries older than :older_than seconds, grouped ones (requests without a lease) older
-- than :grouped_older_than (by their last request); how many.
DELETE FROM audit_log
WHERE at < {now} - :older_than
   OR (group_key IS NOT NULL AND COALESCE(last_at, at) < {now} - :grouped_older_than);
SELECT changes() AS changed;
