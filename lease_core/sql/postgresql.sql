-- Every state change of Fencegate on PostgreSQL, by name (lease_core/catalogue.py).
--
-- Format: "-- name: <operation>" starts an operation, the comment lines after it say
-- what it does; then its statements, each ending with ";" at the end of a line. The
-- statements of one operation run in order in one transaction; each one's first row is
-- merged into the operation's answer, and its columns become parameters of the
-- statements after it (NULL when it returned no row). "-- name: <operation> (many)" is
-- the form that concurrent callers share (lease_core.statement.Batched): each ":name" is
-- then the array of every caller's value, and the column "n" says which caller a row
-- answers; "(many, one at a time)": its batches are sent one after another, never two
-- at once (claims: they would contend for the same rows; renewals: one batch at a time
-- gathers the callers into fewer, larger batches, measured faster through the API,
-- docs/performance.md). "{now}" is the authoritative time
-- (PostgreSQL's clock, or an injected one); "{State.X}" and "{RecordState.X}" are the
-- states of lease_core.rules, as literals, and "{Reason.X}" a reason of
-- fencegate_client.reasons (a verdict the SQL gives: "refusal"). An operation named
-- with "(rows)" is a listing: one read, whose answer is every row it found. A
-- "-- fragment: <name>" header, a comment, then SQL with no ";" defines a rule that
-- several statements share, and "{name}" in a statement (or in another fragment) stands
-- for it; with "(row)" after its name it is a rule about a row of whatever alias its
-- statement gives it, written "{row}.column" and used as "{name(r)}": the header of
-- common.sql says where one goes.
-- lease_core/sql/sqlite.sql defines the same operations for SQLite; those whose SQL is
-- the same on both are in lease_core/sql/common.sql instead (an operation lives in
-- exactly one file).


-- ---------------------------------------------------------------------------------------
-- Rules: this dialect's fragments (the others are in common.sql)
-- ---------------------------------------------------------------------------------------

-- fragment: new_job
-- A new pending job, nothing when the id is taken; a job created again after a purge
-- continues above its last generation (job_tombstones).
INSERT INTO jobs (job_id, queue, state, generation, attempts, max_attempts, payload,
                  claimable_at, created_at, updated_at)
VALUES (CAST(:job_id AS text), :queue, {State.PENDING},
        COALESCE((SELECT t.generation FROM job_tombstones AS t WHERE t.job_id = :job_id), 0),
        0, :max_attempts, CAST(:payload AS jsonb), {now}, {now}, {now})
ON CONFLICT (job_id) DO NOTHING

-- fragment: result_json
-- The result a lease completes its job with (:result, JSON text), as the column keeps it.
CAST(:result AS jsonb)


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
-- expired, or the same owner holds it (a restarted process under the same name fences
-- its predecessor off); the grant is recorded in leases. granted NULL: refused, and
-- found_state / found_expires_at say why.
{new_job};
WITH found AS (
    SELECT j.state, j.lease_expires_at FROM jobs AS j WHERE j.job_id = :job_id
),
granted AS (
    UPDATE jobs SET
        state = {State.LEASED}, generation = jobs.generation + 1, owner = :owner,
        lease_token_hash = :token_hash, lease_ttl_seconds = :ttl,
        lease_expires_at = {now} + :ttl, claimable_at = {now} + :ttl,
        attempts = jobs.attempts + 1, updated_at = {now}
    WHERE job_id = :job_id
      AND (state = {State.PENDING} OR {lease_expired(jobs)}
           OR (state = {State.LEASED} AND owner = :owner))
    RETURNING job_id, generation, owner, lease_expires_at, lease_ttl_seconds, payload
),
recorded AS (
    INSERT INTO leases (token_hash, job_id, generation, owner, granted_at, expires_at)
    SELECT :token_hash, job_id, generation, owner, {now}, lease_expires_at FROM granted
)
SELECT granted.*, granted.job_id IS NOT NULL AS granted,
       found.state AS found_state, found.lease_expires_at AS found_expires_at
FROM found LEFT JOIN granted ON true;

-- name: claim (many, one at a time)
-- Lease the next claimable job of a queue (pending and due, or leased with an expired
-- lease, with attempts left), and record the grant. For each queue asked for, as many
-- candidates as callers (skipping rows other claims hold), in claimable order; the k-th
-- caller of a queue gets its k-th candidate, or nothing when the queue had fewer. One
-- batch at a time: two at once go for the same first rows of the queue, each skipping
-- the rows the other holds and re-checking the ones it has just claimed (the benchmark
-- saw PostgreSQL spend four to seven times the CPU per claim that way).
WITH input AS (
    SELECT i.*, row_number() OVER (PARTITION BY i.queue ORDER BY i.n) AS k
    FROM unnest(CAST(:queue AS text[]), CAST(:owner AS text[]), CAST(:token_hash AS text[]),
                CAST(:ttl AS double precision[]))
         WITH ORDINALITY AS i(queue, owner, token_hash, ttl, n)
),
candidate AS (
    SELECT c.job_id, q.queue,
           row_number() OVER (PARTITION BY q.queue ORDER BY c.claimable_at, c.job_id) AS k
    FROM (SELECT queue, count(*) AS wanted FROM input GROUP BY queue) AS q
    CROSS JOIN LATERAL (
        SELECT j.job_id, j.claimable_at FROM jobs AS j
        WHERE j.queue = q.queue AND {claimable(j)}
        ORDER BY j.claimable_at LIMIT q.wanted
        FOR UPDATE SKIP LOCKED
    ) AS c
),
granted AS (
    UPDATE jobs SET
        state = {State.LEASED}, generation = jobs.generation + 1, owner = i.owner,
        lease_token_hash = i.token_hash, lease_ttl_seconds = i.ttl,
        lease_expires_at = {now} + i.ttl, claimable_at = {now} + i.ttl,
        attempts = jobs.attempts + 1, updated_at = {now}
    FROM candidate JOIN input AS i ON i.queue = candidate.queue AND i.k = candidate.k
    WHERE jobs.job_id = candidate.job_id
    RETURNING i.n, i.token_hash, jobs.job_id, jobs.generation, jobs.owner,
              jobs.lease_expires_at, jobs.lease_ttl_seconds, jobs.payload
),
recorded AS (
    INSERT INTO leases (token_hash, job_id, generation, owner, granted_at, expires_at)
    SELECT token_hash, job_id, generation, owner, {now}, lease_expires_at FROM granted
)
SELECT * FROM granted;

-- name: renew (many, one at a time)
-- Concurrent renewals (common.sql's "renew") in one statement. A token asked for twice in one batch is renewed
-- once, with its last caller's ttl, and every caller of it gets the renewed lease (as if
-- the renewals ran one after the other at the same instant). Rows are locked in job_id
-- order, so two batches never wait on each other in a cycle.
WITH input AS (
    SELECT * FROM unnest(CAST(:token_hash AS text[]), CAST(:ttl AS double precision[]))
         WITH ORDINALITY AS i(token_hash, ttl, n)
),
wanted AS (
    SELECT DISTINCT ON (token_hash) token_hash, ttl FROM input ORDER BY token_hash, n DESC
),
locked AS (
    SELECT j.job_id FROM jobs AS j
    WHERE j.lease_token_hash IN (SELECT token_hash FROM wanted)
    ORDER BY j.job_id
    FOR UPDATE OF j
),
renewed AS (
    UPDATE jobs SET
        lease_ttl_seconds = COALESCE(w.ttl, jobs.lease_ttl_seconds),
        lease_expires_at = {now} + COALESCE(w.ttl, jobs.lease_ttl_seconds),
        claimable_at = {now} + COALESCE(w.ttl, jobs.lease_ttl_seconds),
        updated_at = {now}
    FROM locked, wanted AS w
    WHERE jobs.job_id = locked.job_id AND jobs.lease_token_hash = w.token_hash
      AND {lease_current(jobs)}
    RETURNING jobs.lease_token_hash, jobs.job_id, jobs.generation, jobs.owner,
              jobs.lease_expires_at, jobs.lease_ttl_seconds, jobs.payload
)
SELECT i.n, renewed.* FROM input AS i JOIN renewed ON renewed.lease_token_hash = i.token_hash;

-- name: purge_job
-- Delete a job that no current lease holds and none of whose writes is in flight,
-- remember its last generation (job_tombstones), and drop the gateway's records of its
-- writes. The job row is locked first: an admission holds it (FOR SHARE) until it
-- commits, so the statements after see every write admitted before. found NULL: no
-- such job; purged_generation NULL: refused (writing says whether a write is in flight).
SELECT job_id AS found FROM jobs WHERE job_id = :job_id FOR UPDATE;
SELECT EXISTS (
    SELECT 1 FROM writes_in_flight AS w WHERE w.job_id = :job_id AND {in_flight(w)}
) AS writing;
DELETE FROM jobs
WHERE job_id = :job_id AND NOT CAST(:writing AS boolean)
  AND NOT ({lease_current(jobs)})
RETURNING generation AS purged_generation;
DELETE FROM idempotency_records
WHERE job_id = :job_id AND CAST(:purged_generation AS bigint) IS NOT NULL;
DELETE FROM writes_in_flight
WHERE job_id = :job_id AND CAST(:purged_generation AS bigint) IS NOT NULL;
INSERT INTO job_tombstones (job_id, generation, purged_at)
SELECT CAST(:job_id AS text), CAST(:purged_generation AS bigint), {now}
WHERE CAST(:purged_generation AS bigint) IS NOT NULL
ON CONFLICT (job_id) DO UPDATE
    SET generation = excluded.generation, purged_at = excluded.purged_at;

-- name: fail_exhausted
-- Expired leases on their last attempt become failed (a worker that keeps crashing on a
-- job must not get it forever); how many.
WITH failed AS (
    UPDATE jobs SET
        state = {State.FAILED}, error = 'the lease expired on the last attempt',
        lease_token_hash = NULL, claimable_at = NULL, lease_expires_at = NULL,
        updated_at = {now}
    WHERE {lease_expired(jobs)} AND attempts >= max_attempts
    RETURNING 1
)
SELECT count(*) AS changed FROM failed;

-- name: purge_grants
-- Forget grants that expired before the cutoff ({now} - :older_than seconds), from
-- :since (the previous step's cutoff: a grant is looked at when it crosses the cutoff,
-- not again at every step; -Infinity looks at all) to before :until (Infinity: the
-- cutoff); their tokens then answer "invalid" instead of "stale". A job's current grant
-- is always kept. How many, and the cutoff.
WITH purged AS (
    DELETE FROM leases AS l
    WHERE l.expires_at >= CAST(:since AS double precision)
      AND l.expires_at < LEAST(CAST(:until AS double precision), {now} - :older_than)
      AND NOT EXISTS (
          SELECT 1 FROM jobs AS j WHERE j.job_id = l.job_id AND j.generation = l.generation
      )
    RETURNING 1
)
SELECT count(*) AS changed, {now} - :older_than AS cutoff FROM purged;


-- ---------------------------------------------------------------------------------------
-- The gateway's writes
-- ---------------------------------------------------------------------------------------

-- fragment: admission_of_input
-- The admission of each row of the CTE input (token_hash, key, fingerprint, attempt,
-- upstream, method, path, deadline_in, retry, and n: which caller) at clock.now: the
-- rest of the WITH list of admit and admit (many), and their answer.
-- A fenced write is admitted: the lease is current (judged: the verdict lease_refusal
-- on the grant and its job row, locked FOR SHARE so no reclaim slips in, is NULL; it is
-- the answer's refusal), the job's fence is raised to this generation, the key is claimed
-- for this attempt, or its record is read; a record of the same request whose outcome is
-- unknown (or in flight past its deadline) is taken over when the upstream's policy is
-- retry (:retry), and either marked in writes_in_flight; and whether an older
-- generation's write is still in flight. The outer SELECT reads the snapshot from
-- before the CTEs ran: a key claimed here shows as claimed with r.* NULL, a record taken
-- over as it was before. Two writes of one job in one batch hold the same lease, so the
-- fence is raised once per job (DISTINCT ON);
-- rows are locked in job_id (and key) order, so two batches cannot deadlock on them.
-- A key's record is looked up by (job_id, key) in a LATERAL subquery that the planner
-- cannot merge into the join: both columns are then the primary key's index condition,
-- whatever the statistics say about job_id (with a plain join, statistics that called
-- job_id unique made it read every record the job ever had).
lease AS (
    SELECT i.n, l.job_id, l.generation, l.owner
    FROM input AS i JOIN leases AS l ON l.token_hash = i.token_hash
),
job AS (
    SELECT j.job_id, j.state, j.generation, j.owner, j.lease_expires_at, j.attempts,
           j.max_attempts
    FROM jobs AS j WHERE j.job_id IN (SELECT lease.job_id FROM lease)
    ORDER BY j.job_id
    FOR SHARE OF j
),
judged AS (
    SELECT i.n, lease.job_id, lease.generation,
           {lease_refusal(lease, job)} AS refusal
    FROM input AS i
    LEFT JOIN lease ON lease.n = i.n
    LEFT JOIN job ON job.job_id = lease.job_id
),
current_lease AS (
    SELECT judged.n, judged.job_id, judged.generation FROM judged WHERE judged.refusal IS NULL
),
raised AS (
    INSERT INTO fences (job_id, generation, updated_at)
    SELECT DISTINCT ON (c.job_id) c.job_id, c.generation, clock.now
    FROM current_lease AS c CROSS JOIN clock
    ORDER BY c.job_id, c.generation DESC
    {raise_fence}
),
claim AS (
    INSERT INTO idempotency_records (job_id, key, fingerprint, state, generation, attempt,
                                     upstream, method, path, deadline, created_at, updated_at)
    SELECT c.job_id, i.key, i.fingerprint, {RecordState.IN_FLIGHT}, c.generation, i.attempt,
           i.upstream, i.method, i.path, clock.now + i.deadline_in, clock.now, clock.now
    FROM current_lease AS c JOIN input AS i ON i.n = c.n CROSS JOIN clock
    ORDER BY c.job_id, i.key
    ON CONFLICT (job_id, key) DO NOTHING
    RETURNING job_id, key, generation, attempt, deadline
),
held AS (
    SELECT r.job_id, r.key, r.attempt AS taken_from, i.attempt, c.generation, i.deadline_in
    FROM current_lease AS c
    JOIN input AS i ON i.n = c.n
    CROSS JOIN LATERAL (
        SELECT * FROM idempotency_records AS x
        WHERE x.job_id = c.job_id AND x.key = i.key
        OFFSET 0
    ) AS r
    WHERE i.retry AND r.fingerprint = i.fingerprint
      AND {unknown_or_overdue(r)}
    ORDER BY r.job_id, r.key
    FOR UPDATE OF r
),
taken AS (
    UPDATE idempotency_records AS r
    SET state = {RecordState.IN_FLIGHT}, generation = h.generation, attempt = h.attempt,
        deadline = clock.now + h.deadline_in, updated_at = clock.now, unknown_at = NULL
    FROM held AS h CROSS JOIN clock
    WHERE r.job_id = h.job_id AND r.key = h.key AND r.attempt = h.taken_from
    RETURNING r.job_id, r.key, r.generation, r.attempt, r.deadline
),
marked AS (
    INSERT INTO writes_in_flight (job_id, key, generation, attempt, deadline)
    SELECT job_id, key, generation, attempt, deadline FROM claim
    UNION ALL
    SELECT job_id, key, generation, attempt, deadline FROM taken
    {mark_in_flight}
)
SELECT i.n, clock.now,
       lease.job_id, lease.generation AS lease_generation, lease.owner AS lease_owner,
       job.state, job.generation, job.owner, job.lease_expires_at, job.attempts,
       job.max_attempts,
       (SELECT f.generation FROM fences AS f WHERE f.job_id = lease.job_id) AS fence_generation,
       {lease_older_in_flight(lease)} AS older_in_flight,
       judged.refusal,
       r.fingerprint, r.state AS r_state, r.generation AS r_generation,
       r.attempt AS r_attempt, r.deadline, {past_deadline(r)} AS overdue, r.status,
       r.headers, r.body,
       EXISTS (SELECT 1 FROM claim WHERE claim.attempt = i.attempt) AS claimed,
       EXISTS (SELECT 1 FROM taken WHERE taken.attempt = i.attempt) AS taken
FROM input AS i
CROSS JOIN clock
JOIN judged ON judged.n = i.n
LEFT JOIN lease ON lease.n = i.n
LEFT JOIN job ON job.job_id = lease.job_id
LEFT JOIN LATERAL (
    SELECT * FROM idempotency_records AS x
    WHERE x.job_id = lease.job_id AND x.key = i.key
    LIMIT 1
) AS r ON true

-- name: admit
-- One caller's admission (admission_of_input), its input one row of scalars. PostgreSQL
-- keeps one plan of it for every call; the array form it plans again at each call, as a
-- plan for arrays of unknown length is estimated dearer (docs/performance.md: 0.44 ms a
-- call against 1.2 ms, nearly all of the difference planning).
WITH clock AS (SELECT {now} AS now),
input AS (
    SELECT CAST(:token_hash AS text) AS token_hash, CAST(:key AS text) AS key,
           CAST(:fingerprint AS text) AS fingerprint, CAST(:attempt AS text) AS attempt,
           CAST(:upstream AS text) AS upstream, CAST(:method AS text) AS method,
           CAST(:path AS text) AS path, CAST(:deadline_in AS double precision) AS deadline_in,
           CAST(:retry AS boolean) AS retry, CAST(1 AS bigint) AS n
),
{admission_of_input};

-- name: admit (many)
-- Concurrent admissions in one statement (admission_of_input), one row of input each.
WITH clock AS (SELECT {now} AS now),
input AS (
    SELECT * FROM unnest(
        CAST(:token_hash AS text[]), CAST(:key AS text[]), CAST(:fingerprint AS text[]),
        CAST(:attempt AS text[]), CAST(:upstream AS text[]), CAST(:method AS text[]),
        CAST(:path AS text[]), CAST(:deadline_in AS double precision[]),
        CAST(:retry AS boolean[])
    ) WITH ORDINALITY AS i(token_hash, key, fingerprint, attempt, upstream, method, path,
                           deadline_in, retry, n)
),
{admission_of_input};

-- name: claim_state (many)
-- common.sql's "claim_state" for many callers in one statement.
SELECT i.n, clock.now, f.generation AS fence_generation, r.deadline,
       EXISTS (
           SELECT 1 FROM writes_in_flight AS o
           WHERE o.job_id = i.job_id AND o.generation < r.generation AND {in_flight(o)}
       ) AS older_in_flight
FROM unnest(CAST(:job_id AS text[]), CAST(:key AS text[]), CAST(:attempt AS text[]))
     WITH ORDINALITY AS i(job_id, key, attempt, n)
CROSS JOIN (SELECT {now} AS now) AS clock
LEFT JOIN fences AS f ON f.job_id = i.job_id
LEFT JOIN idempotency_records AS r
    ON r.job_id = i.job_id AND r.key = i.key AND r.attempt = i.attempt
   AND r.state = {RecordState.IN_FLIGHT};

-- name: settle
-- Store the answer of our attempt (completed, or unknown outcome) and take the record
-- out of writes_in_flight; a record another attempt has taken over meanwhile is left
-- alone, and so is its marker. No column that an index of the records names changes
-- (unknown_at stays NULL for an answer): PostgreSQL keeps the update heap-only.
WITH settled AS (
    UPDATE idempotency_records
    SET state = :state, status = :status, headers = CAST(:headers AS json), body = :body,
        note = :note, settled_at = {now}, unknown_at = {unknown_since}
    WHERE job_id = :job_id AND key = :key AND attempt = :attempt
)
{unmark_attempt};

-- name: settle (many)
WITH v AS (
    SELECT * FROM unnest(
        CAST(:job_id AS text[]), CAST(:key AS text[]), CAST(:attempt AS text[]),
        CAST(:state AS text[]), CAST(:status AS integer[]), CAST(:headers AS text[]),
        CAST(:body AS bytea[]), CAST(:note AS text[])
    ) WITH ORDINALITY AS v(job_id, key, attempt, state, status, headers, body, note, n)
),
settled AS (
    UPDATE idempotency_records AS r
    SET state = v.state, status = v.status, headers = CAST(v.headers AS json),
        body = v.body, note = v.note, settled_at = {now},
        unknown_at = CASE WHEN v.state = {RecordState.UNKNOWN} THEN {now} END
    FROM v
    WHERE r.job_id = v.job_id AND r.key = v.key AND r.attempt = v.attempt
    RETURNING v.n
),
unmarked AS (
    DELETE FROM writes_in_flight AS w USING v
    WHERE w.job_id = v.job_id AND w.key = v.key AND w.attempt = v.attempt
)
SELECT n FROM settled;

-- name: audit (many)
-- Concurrent entries (common.sql's "audit") in one statement: replays and refusals under
-- load share one round trip.
INSERT INTO audit_log (at, reason, status, job_id, generation, highest_generation, owner,
                       upstream, method, path, idempotency_key, client, fingerprint, body,
                       replica)
SELECT {now}, v.reason, v.status, v.job_id, v.generation, v.highest_generation, v.owner,
       v.upstream, v.method, v.path, v.idempotency_key, v.client, v.fingerprint, v.body,
       v.replica
FROM unnest(CAST(:reason AS text[]), CAST(:status AS integer[]), CAST(:job_id AS text[]),
            CAST(:generation AS bigint[]), CAST(:highest_generation AS bigint[]),
            CAST(:owner AS text[]), CAST(:upstream AS text[]), CAST(:method AS text[]),
            CAST(:path AS text[]), CAST(:idempotency_key AS text[]),
            CAST(:client AS text[]), CAST(:fingerprint AS text[]), CAST(:body AS bytea[]),
            CAST(:replica AS text[]))
     WITH ORDINALITY AS v(reason, status, job_id, generation, highest_generation, owner,
                          upstream, method, path, idempotency_key, client, fingerprint,
                          body, replica, n)
ORDER BY v.n;

-- name: hold_for_resolution
-- Our attempt's outcome is unknown and the gateway may resolve it itself (the upstream's
-- unknown_outcome is "resolve"): as settle, keeping the request as it was forwarded (its
-- query and headers without the configured secrets, its body) for the re-send.
WITH held AS (
    UPDATE idempotency_records
    SET state = {RecordState.UNKNOWN}, status = :status, headers = CAST(:headers AS json),
        body = :body, note = :note, request_head = CAST(:request_head AS json),
        request_body = :request_body, updated_at = {now}, unknown_at = {now}
    WHERE job_id = :job_id AND key = :key AND attempt = :attempt
)
{unmark_attempt};

-- name: claim_resolution
-- Claim one unknown outcome of :upstream for a re-send by the gateway (gateway.resolve):
-- its request kept, first sent less than :window seconds ago, re-sent fewer than
-- :max_attempts times and not in the last :pause seconds, and no newer generation of its
-- job admitted (the fence not above its generation). It becomes in flight under
-- :attempt until :deadline_in from now, so a newer generation's write waits for it and a
-- worker's retry is told it is in progress; its re-sends are counted. Replicas never
-- claim one record twice: the record and the job's fence row are locked, and what
-- another transaction holds is skipped. No row: nothing to resolve now. The candidates
-- come from the unknown records' index and writes_in_flight's deadlines, each looked
-- up by its primary key (a LATERAL subquery, as in admission_of_input): never a read of
-- every record, every resolve round. An outcome unknown since before the window was
-- sent before it too; bounded on both sides, the range is a small part of the index to
-- a planner with no statistics.
WITH clock AS (SELECT {now} AS now),
candidate AS (
    SELECT r.job_id, r.key FROM idempotency_records AS r CROSS JOIN clock
    WHERE r.unknown_at > clock.now - CAST(:window AS double precision)
      AND r.unknown_at <= clock.now
    UNION ALL
    SELECT w.job_id, w.key FROM writes_in_flight AS w
    WHERE {past_deadline(w)}
),
found AS (
    SELECT r.job_id, r.key
    FROM candidate AS c
    CROSS JOIN LATERAL (
        SELECT * FROM idempotency_records AS x
        WHERE x.job_id = c.job_id AND x.key = c.key
        OFFSET 0
    ) AS r
    JOIN fences AS f ON f.job_id = r.job_id AND f.generation <= r.generation
    CROSS JOIN clock
    WHERE r.upstream = CAST(:upstream AS text)
      AND {unknown_or_overdue(r)}
      AND r.request_body IS NOT NULL
      AND r.created_at > clock.now - CAST(:window AS double precision)
      AND r.resolve_attempts < CAST(:max_attempts AS integer)
      AND r.updated_at <= clock.now - CAST(:pause AS double precision)
    ORDER BY r.updated_at
    LIMIT 1
    FOR UPDATE OF r, f SKIP LOCKED
),
claimed AS (
    UPDATE idempotency_records AS r
    SET state = {RecordState.IN_FLIGHT}, attempt = CAST(:attempt AS text),
        deadline = clock.now + CAST(:deadline_in AS double precision),
        resolve_attempts = r.resolve_attempts + 1, updated_at = clock.now, unknown_at = NULL
    FROM found CROSS JOIN clock
    WHERE r.job_id = found.job_id AND r.key = found.key
    RETURNING r.job_id, r.key, r.generation, r.attempt, r.deadline, r.fingerprint, r.method,
              r.path, CAST(r.request_head AS text) AS request_head, r.request_body,
              r.resolve_attempts
),
marked AS (
    INSERT INTO writes_in_flight (job_id, key, generation, attempt, deadline)
    SELECT job_id, key, generation, attempt, deadline FROM claimed
    {mark_in_flight}
)
SELECT job_id, key, generation, fingerprint, method, path, request_head, request_body,
       resolve_attempts
FROM claimed;

-- name: settle_resolution
-- The end of a re-send by the gateway, while the record is still our attempt: its
-- answer (completed), or unknown again; the kept request stays only for another
-- re-send (:keep_request), else it goes. No row: the record is no longer ours.
WITH settled AS (
    UPDATE idempotency_records
    SET state = :state, status = :status, headers = CAST(:headers AS json), body = :body,
        note = :note,
        request_head = CASE WHEN CAST(:keep_request AS boolean) THEN request_head END,
        request_body = CASE WHEN CAST(:keep_request AS boolean) THEN request_body END,
        updated_at = {now}, settled_at = {now}, unknown_at = {unknown_since}
    WHERE job_id = :job_id AND key = :key AND attempt = :attempt
    RETURNING 1 AS changed
),
unmarked AS (
    {unmark_attempt}
)
SELECT changed FROM settled;

-- name: resolve_applied
-- An operator says an unknown outcome was applied: later duplicates replay this answer.
-- No row: the key's outcome is not (or no longer) unknown. Its marker goes with it (in
-- flight past its deadline).
WITH applied AS (
    UPDATE idempotency_records
    SET state = {RecordState.COMPLETED}, status = :status, headers = CAST(:headers AS json),
        body = :body, note = 'resolved by an operator: applied', updated_at = {now},
        settled_at = {now}, unknown_at = NULL
    WHERE job_id = :job_id AND key = :key
      AND {unknown_or_overdue(idempotency_records)}
    RETURNING 1 AS changed
),
unmarked AS (
    DELETE FROM writes_in_flight
    WHERE job_id = :job_id AND key = :key AND EXISTS (SELECT 1 FROM applied)
)
SELECT changed FROM applied;

-- name: forget
-- A write without a key completed: its record (kept only for ordering) and its marker
-- go.
WITH record AS (
    DELETE FROM idempotency_records
    WHERE job_id = :job_id AND key = :key AND attempt = :attempt
)
{unmark_attempt};

-- name: purge_records
-- Completed records past retention (counted from when they last changed hands: their
-- admission, or their resolution), the oldest :limit of them (NULL: all; those another
-- replica's upkeep holds are skipped); never an unknown or in-flight one. How many.
-- The rows are found once and deleted by their row ids (a TID scan with no statistics
-- and with stale ones), through the index of updated_at: bounded on both sides (from
-- -Infinity), the range is a small part of it to a planner with no statistics, where
-- "older than" alone is a third of the table.
WITH purged AS (
    DELETE FROM idempotency_records
    WHERE ctid = ANY (ARRAY(
        SELECT ctid FROM idempotency_records
        WHERE state = {RecordState.COMPLETED}
          AND updated_at >= CAST('-Infinity' AS double precision)
          AND updated_at < {now} - :older_than
        ORDER BY updated_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ))
    RETURNING 1
)
SELECT count(*) AS changed FROM purged;


-- ---------------------------------------------------------------------------------------
-- The audit
-- ---------------------------------------------------------------------------------------

-- name: purge_audit
-- Entries older than :older_than seconds, grouped ones (requests without a lease) older
-- than :grouped_older_than (by their last request), :limit of each at most (NULL: all;
-- those another replica's upkeep holds are skipped); how many, and the two cutoffs.
-- Each kind is looked for from :since and :grouped_since on (the previous step's
-- cutoffs: an entry is looked at when it crosses its cutoff, not again at every step;
-- -Infinity looks at all), each through its own index. Bounded on both sides, a range is
-- a small part of an index to a planner with no statistics; "older than" alone was a
-- third of the table, and the grouped rows nearly all of it, so PostgreSQL read the
-- whole audit once a minute.
WITH old AS (
    SELECT id FROM audit_log
    WHERE at >= CAST(:since AS double precision) AND at < {now} - :older_than
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), grouped AS (
    SELECT id FROM audit_log
    WHERE group_key IS NOT NULL
      AND last_at >= CAST(:grouped_since AS double precision)
      AND last_at < {now} - :grouped_older_than
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), purged AS (
    DELETE FROM audit_log
    WHERE id = ANY (ARRAY(SELECT id FROM old) || ARRAY(SELECT id FROM grouped))
    RETURNING 1
)
SELECT count(*) AS changed, {now} - :older_than AS cutoff,
       {now} - :grouped_older_than AS grouped_cutoff
FROM purged;
