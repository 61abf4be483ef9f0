/**
 * What a worker needs of Fencegate: enqueue, claim or acquire a lease that renews itself
 * in the background (at a third of its TTL, as the Python client does), fenced writes
 * through the proxy listener with a step key, and complete, fail or release. The calls
 * are made with openapi-fetch on the types openapi-typescript generates from
 * docs/openapi.json (`npm run generate`), with both tools' defaults.
 */

import createClient, { type Client } from "openapi-fetch";

import { errorFromProblem, isProblem, LeaseLost, type Problem, type Sent } from "./errors.js";
import type { components, paths } from "./schema.js";

export type Job = components["schemas"]["Job"];
export type LeaseGrant = components["schemas"]["LeaseGrant"];
export type EnqueueBody = components["schemas"]["EnqueueBody"];

export interface FencegateOptions {
  /** The control listener, e.g. http://127.0.0.1:8081 (the lease API). */
  controlUrl: string;
  /** The proxy listener, e.g. http://127.0.0.1:8080 (fenced writes). */
  proxyUrl: string;
  /** A worker token (auth.worker_tokens), if the gateway has tokens. */
  token?: string;
  fetch?: typeof globalThis.fetch;
}

export interface GrantOptions {
  owner: string;
  ttlSeconds?: number;
  /** Renew in the background at a third of the TTL (default true). */
  renew?: boolean;
  /** Told when a background renewal finds the lease lost (or cannot reach the server). */
  onLost?: (error: Error) => void;
}

export interface WriteOptions {
  /** The step's Idempotency-Key: the same for every retry of the step, in any generation. */
  key: string;
  /** A JSON body (serialised, Content-Type application/json). */
  json?: unknown;
  /** Raw bytes, sent with `contentType` (default application/octet-stream). */
  body?: Uint8Array | string;
  contentType?: string;
  headers?: Record<string, string>;
  /** Throw the typed error of a problem the gateway answered itself (default true). */
  throwOnProblem?: boolean;
}

/** An upstream's answer as relayed (or replayed) by the gateway, or the gateway's own. */
export class FencedResponse {
  constructor(
    readonly status: number,
    readonly headers: Headers,
    readonly body: Uint8Array,
  ) {}

  /** The stored answer replayed to a duplicate: the upstream was not called again. */
  get replayed(): boolean {
    return this.headers.get("Idempotent-Replayed") === "true";
  }

  json(): unknown {
    return JSON.parse(new TextDecoder().decode(this.body));
  }

  /** The gateway's own problem document, when the gateway answered itself. */
  get problem(): Problem | undefined {
    const contentType = this.headers.get("Content-Type");
    if (!(contentType ?? "").startsWith("application/problem+json")) return undefined;
    const doc: unknown = this.json();
    return isProblem(contentType, doc) ? doc : undefined;
  }

  /** What became of the write when the gateway answered itself; undefined for the
   * upstream's answer. */
  get sent(): Sent | undefined {
    return this.problem?.sent;
  }

  /** Only `never` allows the write again under a new key. */
  get newKeySafe(): boolean {
    return this.sent === "never";
  }

  raiseForProblem(): void {
    const problem = this.problem;
    if (problem !== undefined) throw errorFromProblem(problem);
  }
}

function check<T>(answer: { data?: T; error?: unknown; response: Response }): T {
  if (answer.error !== undefined || !answer.response.ok) {
    const doc = answer.error;
    const contentType = answer.response.headers.get("Content-Type");
    if (isProblem(contentType, doc)) throw errorFromProblem(doc);
    throw errorFromProblem({ status: answer.response.status, reason: "", detail: String(doc) });
  }
  return answer.data as T;
}

const TOKEN_CHARS = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;

/** A key as the Idempotency-Key header carries it: a bare run of token characters as it
 * is, anything else as a structured-field string ("order:9"), which the gateway takes as
 * the same key. */
export function keyHeader(key: string): string {
  if (TOKEN_CHARS.test(key)) return key;
  if (!/^[\x20-\x7e]+$/.test(key)) throw new RangeError(`an Idempotency-Key is printable ASCII: ${key}`);
  return `"${key.replace(/[\\"]/g, (c) => `\\${c}`)}"`;
}

export class Fencegate {
  readonly control: Client<paths>;
  readonly proxyUrl: string;
  private readonly fetchImpl: typeof globalThis.fetch;

  constructor(options: FencegateOptions) {
    this.fetchImpl = options.fetch ?? globalThis.fetch;
    this.control = createClient<paths>({
      baseUrl: options.controlUrl,
      headers: options.token ? { Authorization: `Bearer ${options.token}` } : {},
      fetch: this.fetchImpl,
    });
    this.proxyUrl = options.proxyUrl.replace(/\/+$/, "");
  }

  async enqueue(job: EnqueueBody = {}): Promise<Job> {
    return check(await this.control.POST("/v1/jobs", { body: job }));
  }

  async getJob(jobId: string): Promise<Job> {
    return check(
      await this.control.GET("/v1/jobs/{job_id}", { params: { path: { job_id: jobId } } }),
    );
  }

  /** The next claimable job of `queue`, leased; undefined when there is none. */
  async claim(queue: string, options: GrantOptions): Promise<Lease | undefined> {
    const answer = await this.control.POST("/v1/queues/{queue}/claim", {
      params: { path: { queue } },
      body: { owner: options.owner, ttl_seconds: options.ttlSeconds },
    });
    if (answer.response.status === 204) return undefined;
    return this.started(check(answer), options);
  }

  /** A named job's lease (the job is created if absent); LeaseHeld while another holds it. */
  async acquire(
    jobId: string,
    options: GrantOptions & { queue?: string; payload?: unknown; maxAttempts?: number },
  ): Promise<Lease> {
    const answer = await this.control.PUT("/v1/jobs/{job_id}/lease", {
      params: { path: { job_id: jobId } },
      body: {
        owner: options.owner,
        ttl_seconds: options.ttlSeconds,
        queue: options.queue,
        payload: options.payload,
        max_attempts: options.maxAttempts,
      },
    });
    return this.started(check(answer), options);
  }

  private started(grant: LeaseGrant, options: GrantOptions): Lease {
    const lease = new Lease(this, grant, options.onLost);
    if (options.renew !== false) lease.startRenewing();
    return lease;
  }

  /** A write through the proxy listener: `/{upstream}/{path}`, nested paths allowed. */
  async write(
    token: string,
    method: "POST" | "PUT" | "PATCH" | "DELETE",
    upstream: string,
    path: string,
    options: WriteOptions,
  ): Promise<FencedResponse> {
    const headers: Record<string, string> = {
      ...options.headers,
      "Fencing-Token": token,
      "Idempotency-Key": keyHeader(options.key),
    };
    let body: Uint8Array | string | undefined = options.body;
    if (options.json !== undefined) {
      body = JSON.stringify(options.json);
      headers["Content-Type"] = "application/json";
    } else if (body !== undefined) {
      headers["Content-Type"] = options.contentType ?? "application/octet-stream";
    }
    const target = `${this.proxyUrl}/${encodeURIComponent(upstream)}/${path.replace(/^\/+/, "")}`;
    const response = await this.fetchImpl(target, { method, headers, body });
    const answer = new FencedResponse(
      response.status,
      response.headers,
      new Uint8Array(await response.arrayBuffer()),
    );
    if (options.throwOnProblem !== false) answer.raiseForProblem();
    return answer;
  }
}

/** A granted lease: its token, the background renewal, fenced writes, its end. */
export class Lease {
  readonly jobId: string;
  readonly generation: number;
  readonly token: string;
  readonly payload: unknown;
  expiresAt: string;
  ttlSeconds: number;
  /** Set when a renewal found the lease lost: stop working on the job. */
  lost: Error | undefined;
  private timer: NodeJS.Timeout | undefined;
  private renewing = false;

  constructor(
    private readonly client: Fencegate,
    grant: LeaseGrant,
    private readonly onLost?: (error: Error) => void,
  ) {
    this.jobId = grant.job_id;
    this.generation = grant.generation;
    this.token = grant.lease_token;
    this.payload = grant.payload;
    this.expiresAt = grant.expires_at;
    this.ttlSeconds = grant.ttl_seconds;
  }

  async renew(ttlSeconds?: number): Promise<void> {
    const renewed = check(
      await this.client.control.POST("/v1/leases/renew", {
        body: { lease_token: this.token, ttl_seconds: ttlSeconds },
      }),
    );
    this.expiresAt = renewed.expires_at;
    this.ttlSeconds = renewed.ttl_seconds;
  }

  startRenewing(): void {
    if (this.renewing) return;
    this.renewing = true;
    const next = (): void => {
      this.timer = setTimeout(() => {
        this.renew().then(
          () => {
            if (this.renewing) next();
          },
          (error: Error) => {
            this.renewing = false;
            if (error instanceof LeaseLost || this.lost === undefined) this.lost = error;
            this.onLost?.(error);
          },
        );
      }, (this.ttlSeconds * 1000) / 3);
      this.timer.unref();
    };
    next();
  }

  stopRenewing(): void {
    this.renewing = false;
    if (this.timer !== undefined) clearTimeout(this.timer);
  }

  /** A fenced write of one step: `key` names the step, the same in every retry. */
  write(
    method: "POST" | "PUT" | "PATCH" | "DELETE",
    upstream: string,
    path: string,
    options: WriteOptions,
  ): Promise<FencedResponse> {
    return this.client.write(this.token, method, upstream, path, options);
  }

  post(upstream: string, path: string, options: WriteOptions): Promise<FencedResponse> {
    return this.write("POST", upstream, path, options);
  }

  async complete(result?: unknown): Promise<Job> {
    this.stopRenewing();
    return check(
      await this.client.control.POST("/v1/leases/complete", {
        body: { lease_token: this.token, result },
      }),
    );
  }

  async fail(error?: string, retryInSeconds?: number): Promise<Job> {
    this.stopRenewing();
    return check(
      await this.client.control.POST("/v1/leases/fail", {
        body: { lease_token: this.token, error, retry_in_seconds: retryInSeconds },
      }),
    );
  }

  async release(): Promise<Job> {
    this.stopRenewing();
    return check(
      await this.client.control.POST("/v1/leases/release", { body: { lease_token: this.token } }),
    );
  }
}
