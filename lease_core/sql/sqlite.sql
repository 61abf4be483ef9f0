-- Every state change of Fencegate on SQLite, by name (lease_core/catalogue.py); the same
-- operations as lease_core/sql/postgresql.sql, whose header explains the format, but
-- those in lease_core/sql/common.sql, the same on both.
--
-- An operation's statements run in one IMMEDIATE transaction (a savepoint of the group
-- transaction of lease_core.direct_sqlite), which keeps every other writer out until it
-- commits: where PostgreSQL needs one statement or a row lock, SQLite runs several
-- statements, each of them conditional, so the SQL decides and the Python only reads
-- the answer. How many rows a statement changed: SELECT changes().


-- ---------------------------------------------------------------------------------------
-- Rules: this dialect's fragments (the others are in common.sql)
-- ---------------------------------------------------------------------------------------

-- fragment: new_job
-- A new pending job, nothing when the id is taken; a job created again after a purge
-- continues above its last generation (job_tombstones).
INSERT INTO jobs (job_id, queue, state, generation, attempts, max_attempts, payload,
                  claimable_at, created_at, updated_at)
VALUES (:job_id, :queue, {State.PENDING},
        COALESCE((SELECT t.generation FROM job_tombstones AS t WHERE t.job_id = :job_id), 0),
        0, :max_attempts, :payload, {now}, {now}, {now})
ON CONFLICT (job_id) DO NOTHING

-- fragment: result_json
-- The result a lease completes its job with (:result, JSON text), as the column keeps it.
:result

-- fragment: grant
-- The SET of a grant: the job row leased to :owner under :token_hash for :ttl seconds,
-- at its next generation, its attempts counted. (postgresql.sql writes it out in acquire
-- and in claim, whose values come from its batch.)
state = {State.LEASED}, generation = generation + 1, owner = :owner,
lease_token_hash = :token_hash, lease_ttl_seconds = :ttl,
lease_expires_at = {now} + :ttl, claimable_at = {now} + :ttl,
attempts = attempts + 1, updated_at = {now}

-- fragment: record_grant
-- The grant just made under :token_hash, recorded in leases.
INSERT INTO leases (token_hash, job_id, generation, owner, granted_at, expires_at)
SELECT lease_token_hash, job_id, generation, owner, {now}, lease_expires_at
FROM jobs WHERE lease_token_hash = :token_hash


-- ---------------------------------------------------------------------------------------
-- Jobs and leases
-- ---------------------------------------------------------------------------------------

-- name: enqueue
-- A new pending job; a job created again after a purge continues above its last
-- generation (job_tombstones). No row: the id is taken.
{new_job}
RETURNING job_id, queue, state, generation, owner, lease_expires_at, attempts,
          max_attempts, payload, result, error, created_at;

-- name: acquire
-- A named job, created pending if absent, is leased when it is pending, its lease
-- expired, or the same owner holds it; the grant is recorded in leases. granted NULL:
-- refused, and found_state / found_expires_at say why.
{new_job};
SELECT state AS found_state, lease_expires_at AS found_expires_at
FROM jobs WHERE job_id = :job_id;
UPDATE jobs SET
    {grant}
WHERE job_id = :job_id
  AND (state = {State.PENDING} OR {lease_expired(jobs)}
       OR (state = {State.LEASED} AND owner = :owner))
RETURNING job_id, generation, owner, lease_expires_at, lease_ttl_seconds, payload,
          1 AS granted;
{record_grant};

-- name: claim
-- Lease the next claimable job of a queue (pending and due, or leased with an expired
-- lease, with attempts left), and record the grant.
UPDATE jobs SET
    {grant}
WHERE job_id = (
    SELECT job_id FROM jobs
    WHERE queue = :queue AND {claimable(jobs)}
    ORDER BY claimable_at LIMIT 1
)
RETURNING job_id, generation, owner, lease_expires_at, lease_ttl_seconds, payload;
{record_grant};

-- name: purge_job
-- Delete a job that no current lease holds and none of whose writes is in flight,
-- remember its last generation (job_tombstones), and drop the gateway's records of its
-- writes. found NULL: no such job; purged_generation NULL: refused (writing says
-- whether a write is in flight).
SELECT job_id AS found FROM jobs WHERE job_id = :job_id;
SELECT EXISTS (
    SELECT 1 FROM writes_in_flight AS w WHERE w.job_id = :job_id AND {in_flight(w)}
) AS writing;
DELETE FROM jobs
WHERE job_id = :job_id AND NOT :writing
  AND NOT ({lease_current(jobs)})
RETURNING generation AS purged_generation;
DELETE FROM idempotency_records
WHERE job_id = :job_id AND :purged_generation IS NOT NULL;
DELETE FROM writes_in_flight
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
WHERE {lease_expired(jobs)} AND attempts >= max_attempts;
SELECT changes() AS changed;

-- name: purge_grants
-- Forget grants that expired before the cutoff ({now} - :older_than seconds), from
-- :since (the previous step's cutoff: a grant is looked at when it crosses the cutoff,
-- not again at every step; -Infinity looks at all) to before :until (Infinity: the
-- cutoff; a sweep of all grants goes in slices); a job's current grant is always kept.
-- How many, and the cutoff.
DELETE FROM leases
WHERE expires_at >= :since AND expires_at < MIN(:until, {now} - :older_than)
  AND NOT EXISTS (
      SELECT 1 FROM jobs AS j
      WHERE j.job_id = leases.job_id AND j.generation = leases.generation
  );
SELECT changes() AS changed, {now} - :older_than AS cutoff;


-- ---------------------------------------------------------------------------------------
-- The gateway's writes
-- ---------------------------------------------------------------------------------------

-- name: admit
-- A fenced write is admitted: the lease is current, the job's fence is raised to this
-- generation, the key is claimed for this attempt, or its record is read; a record of
-- the same request whose outcome is unknown (or in flight past its deadline) is taken
-- over when the upstream's policy is retry (:retry), and either marked in
-- writes_in_flight. The first statement reads the lease, the fence, the older
-- generations' writes and the key's record as they were before, and judges the lease
-- (refusal: lease_refusal, NULL when it may write; admitted: the lease's generation
-- when it may); each later one is conditional on that verdict (the IMMEDIATE
-- transaction keeps every other writer out meanwhile). The key's claim, take-over and
-- mark are admit_external's (common.sql: claim_key, take_over_key, mark_attempt).
SELECT q.*, CASE WHEN q.refusal IS NULL THEN q.lease_generation END AS admitted
FROM (
    SELECT clock.now, l.job_id AS job_id, l.generation AS lease_generation,
           l.owner AS lease_owner,
           j.state, j.generation, j.owner, j.lease_expires_at, j.attempts, j.max_attempts,
           f.generation AS fence_generation,
           {lease_older_in_flight(l)} AS older_in_flight,
           {lease_refusal(l, j)} AS refusal,
           r.fingerprint, r.state AS r_state, r.generation AS r_generation,
           r.attempt AS r_attempt, r.deadline, {past_deadline(r)} AS overdue, r.status,
           r.headers, r.body
    FROM (SELECT {now} AS now) AS clock
    LEFT JOIN leases AS l ON l.token_hash = :token_hash
    LEFT JOIN jobs AS j ON j.job_id = l.job_id
    LEFT JOIN fences AS f ON f.job_id = l.job_id
    LEFT JOIN idempotency_records AS r ON r.job_id = l.job_id AND r.key = :key
) AS q;
INSERT INTO fences (job_id, generation, updated_at)
SELECT :job_id, :admitted, {now}
WHERE :admitted IS NOT NULL
{raise_fence};
{claim_key};
{take_over_key};
{mark_attempt};

-- name: settle
-- Store the answer of our attempt (completed, or unknown outcome) and take the record
-- out of writes_in_flight; a record another attempt has taken over meanwhile is left
-- alone, and so is its marker.
UPDATE idempotency_records
SET state = :state, status = :status, headers = :headers, body = :body, note = :note,
    settled_at = {now}, unknown_at = {unknown_since}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt;
{unmark_attempt};

-- name: hold_for_resolution
-- Our attempt's outcome is unknown and the gateway may resolve it itself (the upstream's
-- unknown_outcome is "resolve"): as settle, keeping the request as it was forwarded (its
-- query and headers without the configured secrets, its body) for the re-send.
UPDATE idempotency_records
SET state = {RecordState.UNKNOWN}, status = :status, headers = :headers, body = :body,
    note = :note, request_head = :request_head, request_body = :request_body,
    updated_at = {now}, unknown_at = {now}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt;
{unmark_attempt};

-- name: claim_resolution
-- Claim one unknown outcome of :upstream for a re-send by the gateway (gateway.resolve):
-- its request kept, first sent less than :window seconds ago, re-sent fewer than
-- :max_attempts times and not in the last :pause seconds, and no newer generation of its
-- job admitted (the fence not above its generation). It becomes in flight under
-- :attempt until :deadline_in from now, so a newer generation's write waits for it and a
-- worker's retry is told it is in progress; its re-sends are counted. The IMMEDIATE
-- transaction keeps every other writer out, so no two claims take one record. No row:
-- nothing to resolve now. The candidates come from the unknown records' index and
-- writes_in_flight's deadlines: never a scan of every record, which would hold the
-- write lock for as long as the table is large, every resolve round.
UPDATE idempotency_records
SET state = {RecordState.IN_FLIGHT}, attempt = :attempt, deadline = {now} + :deadline_in,
    resolve_attempts = resolve_attempts + 1, updated_at = {now}, unknown_at = NULL
WHERE (job_id, key) = (
    SELECT r.job_id, r.key
    FROM idempotency_records AS r
    JOIN fences AS f ON f.job_id = r.job_id AND f.generation <= r.generation
    WHERE r.rowid IN (
        SELECT rowid FROM idempotency_records WHERE unknown_at IS NOT NULL
        UNION ALL
        SELECT x.rowid FROM writes_in_flight
        JOIN idempotency_records AS x
            ON x.job_id = writes_in_flight.job_id AND x.key = writes_in_flight.key
        WHERE {past_deadline(writes_in_flight)}
    )
      AND {unknown_or_overdue(r)}
      AND r.upstream = :upstream
      AND r.request_body IS NOT NULL
      AND r.created_at > {now} - :window
      AND r.resolve_attempts < :max_attempts
      AND r.updated_at <= {now} - :pause
    ORDER BY r.updated_at
    LIMIT 1
)
RETURNING job_id, key, generation, fingerprint, method, path, request_head, request_body,
          resolve_attempts;
INSERT INTO writes_in_flight (job_id, key, generation, attempt, deadline)
SELECT job_id, key, generation, attempt, deadline FROM idempotency_records
WHERE job_id = :job_id AND key = :key AND attempt = :attempt
{mark_in_flight};

-- name: settle_resolution
-- The end of a re-send by the gateway, while the record is still our attempt: its
-- answer (completed), or unknown again; the kept request stays only for another
-- re-send (:keep_request), else it goes. No row: the record is no longer ours.
UPDATE idempotency_records
SET state = :state, status = :status, headers = :headers, body = :body, note = :note,
    request_head = CASE WHEN :keep_request THEN request_head END,
    request_body = CASE WHEN :keep_request THEN request_body END,
    updated_at = {now}, settled_at = {now}, unknown_at = {unknown_since}
WHERE job_id = :job_id AND key = :key AND attempt = :attempt
RETURNING 1 AS changed;
{unmark_attempt};

-- name: resolve_applied
-- An operator says an unknown outcome was applied: later duplicates replay this answer.
-- No row: the key's outcome is not (or no longer) unknown.
UPDATE idempotency_records
SET state = {RecordState.COMPLETED}, status = :status, headers = :headers,
    body = :body, note = 'resolved by an operator: applied', updated_at = {now},
    settled_at = {now}, unknown_at = NULL
WHERE job_id = :job_id AND key = :key
  AND {unknown_or_overdue(idempotency_records)}
RETURNING 1 AS changed;
DELETE FROM writes_in_flight WHERE job_id = :job_id AND key = :key AND :changed IS NOT NULL;

-- name: forget
-- A write without a key completed: its record (kept only for ordering) and its marker
-- go.
DELETE FROM idempotency_records WHERE job_id = :job_id AND key = :key AND attempt = :attempt;
{unmark_attempt};

-- name: purge_records
-- Completed records past retention (counted from when they last changed hands: their
-- admission, or their resolution), the oldest :limit of them; never an unknown or
-- in-flight one. How many.
DELETE FROM idempotency_records
WHERE rowid IN (
    SELECT rowid FROM idempotency_records
    WHERE state = {RecordState.COMPLETED} AND updated_at < {now} - :older_than
    ORDER BY updated_at
    LIMIT :limit
);
SELECT changes() AS changed;


-- ---------------------------------------------------------------------------------------
-- The audit
-- ---------------------------------------------------------------------------------------

-- name: purge_audit
-- Entries older than :older_than seconds, grouped ones (requests without a lease) older
-- than :grouped_older_than (by their last request), :limit of each at most; how many,
-- and the two cutoffs. Each kind is looked for from :since and :grouped_since on (the
-- previous step's cutoffs; -Infinity looks at all), each through its own index: the
-- entries by ``at``, the grouped rows by the partial index of their ``last_at``.
DELETE FROM audit_log
WHERE id IN (
    SELECT id FROM audit_log
    WHERE at >= :since AND at < {now} - :older_than
    LIMIT :limit
) OR id IN (
    SELECT id FROM audit_log
    WHERE group_key IS NOT NULL
      AND last_at >= :grouped_since AND last_at < {now} - :grouped_older_than
    LIMIT :limit
);
SELECT changes() AS changed, {now} - :older_than AS cutoff,
       {now} - :grouped_older_than AS grouped_cutoff;
