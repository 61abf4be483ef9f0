/**
 * The reasons of Fencegate's problem documents as typed errors, mirroring the Python
 * client's `fencegate_client.errors`: one class per reason a worker acts on, each with
 * the problem's `status`, `reason`, `detail`, `sent` and the whole document.
 *
 * `sent` says what became of a write the gateway answered itself: `never` (nothing
 * reached the upstream: send it again, under the same key or a new one), `maybe` (it may
 * have been applied: retry only under the same key, or have the outcome resolved), `yes`
 * (sent and answered: the answer is the outcome). Decide from it alone, never from the
 * detail or a header. It is absent (`undefined`) on the lease API's own problems.
 */

export type Sent = "never" | "maybe" | "yes";

export interface Problem {
  type?: string;
  title?: string;
  status: number;
  detail?: string;
  reason?: string;
  sent?: Sent;
  job_id?: string;
  generation?: number;
  highest_generation?: number;
  [member: string]: unknown;
}

export class FencegateError extends Error {
  readonly status: number;
  readonly reason: string;
  readonly detail: string;
  readonly sent: Sent | undefined;
  readonly problem: Problem;

  constructor(problem: Problem) {
    const detail = problem.detail ?? problem.title ?? `HTTP ${problem.status}`;
    super(detail);
    this.name = new.target.name;
    this.status = problem.status;
    this.reason = problem.reason ?? "";
    this.detail = detail;
    this.sent = problem.sent;
    this.problem = problem;
  }

  /** Whether the write this error answers may be sent again under a new key: only when
   * the gateway says it was never sent. */
  get newKeySafe(): boolean {
    return this.sent === "never";
  }
}

export class InvalidRequest extends FencegateError {}
export class Unauthorized extends FencegateError {}
export class Forbidden extends FencegateError {}
export class InvalidLeaseToken extends FencegateError {}
export class JobNotFound extends FencegateError {}
export class NotFound extends FencegateError {}
export class JobExists extends FencegateError {}
/** The job is held by another current lease; `leaseExpiresAt` says until when. */
export class LeaseHeld extends FencegateError {
  get leaseExpiresAt(): string | undefined {
    const at = this.problem["lease_expires_at"];
    return typeof at === "string" ? at : undefined;
  }
}
export class JobFinished extends FencegateError {}
/** The lease is no longer current: stop working on the job. */
export class LeaseLost extends FencegateError {}
export class LeaseExpired extends LeaseLost {}
export class StaleGeneration extends LeaseLost {}
export class LeaseEnded extends LeaseLost {}
export class GenerationReissued extends LeaseLost {}
export class StoreUnavailable extends FencegateError {}
/** The gateway's refusals of a write that name no lease state. */
export class UnknownUpstream extends FencegateError {}
export class MissingFencingToken extends FencegateError {}
export class InvalidFencingToken extends FencegateError {}
export class MissingIdempotencyKey extends FencegateError {}
export class IdempotencyKeyReused extends FencegateError {}
export class RequestInProgress extends FencegateError {}
/** The key's earlier forward has an unknown outcome (sent `maybe`): retry it only with
 * the same key, once an operator has resolved it (`fencegate outcomes resolve`). */
export class OutcomeUnknown extends FencegateError {}
/** Any other reason: its `reason`, `status` and `sent` are the document's. */
export class RemoteError extends FencegateError {}

const BY_REASON: Record<string, new (problem: Problem) => FencegateError> = {
  "invalid-request": InvalidRequest,
  unauthorized: Unauthorized,
  forbidden: Forbidden,
  "invalid-lease-token": InvalidLeaseToken,
  "job-not-found": JobNotFound,
  "not-found": NotFound,
  "job-exists": JobExists,
  "lease-held": LeaseHeld,
  "job-finished": JobFinished,
  "lease-expired": LeaseExpired,
  "stale-generation": StaleGeneration,
  "lease-ended": LeaseEnded,
  "generation-reissued": GenerationReissued,
  "store-unavailable": StoreUnavailable,
  "unknown-upstream": UnknownUpstream,
  "missing-fencing-token": MissingFencingToken,
  "invalid-fencing-token": InvalidFencingToken,
  "missing-idempotency-key": MissingIdempotencyKey,
  "idempotency-key-reused": IdempotencyKeyReused,
  "request-in-progress": RequestInProgress,
  "outcome-unknown": OutcomeUnknown,
};

/** The error a problem document stands for: the class of its reason, else RemoteError. */
export function errorFromProblem(problem: Problem): FencegateError {
  const cls = BY_REASON[problem.reason ?? ""] ?? RemoteError;
  return new cls(problem);
}

/** The problem document of an answer, when it is one. */
export function isProblem(contentType: string | null, body: unknown): body is Problem {
  return (
    (contentType ?? "").split(";")[0]?.trim() === "application/problem+json" &&
    typeof body === "object" &&
    body !== null &&
    typeof (body as { status?: unknown }).status === "number"
  );
}
