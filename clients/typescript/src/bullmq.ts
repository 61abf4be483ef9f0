/**
 * BullMQ processors fenced by Fencegate: each run of a BullMQ job (its first attempt, a
 * retry, or the re-run of a job BullMQ found stalled) takes a Fencegate lease on a job
 * named after the BullMQ job (`PUT /v1/jobs/{id}/lease`), with an owner of its own. The
 * processor gets the lease and writes through the gateway with it; a run whose lease a
 * later run has taken over is refused `stale-generation` at the gateway, however late it
 * wakes up.
 *
 * Why a Fencegate lease per run and not BullMQ's own lock: BullMQ re-runs a stalled job
 * without counting an attempt (`attemptsMade` is unchanged), and its lock token is a
 * random value, so neither gives a generation that grows with each holder; two runs can
 * share an attempt number. Fencegate grants each generation once, atomically, and never
 * to a second holder while the first is current: the new run waits until the stalled
 * run's lease has ended (its `lease_expires_at`), then holds the next generation.
 */

import { hostname } from "node:os";
import { randomUUID } from "node:crypto";

import type { Job as BullJob, Processor } from "bullmq";

import type { Fencegate, Lease } from "./client.js";
import { JobFinished, LeaseHeld, LeaseLost } from "./errors.js";

export interface FencedProcessorOptions<T> {
  /** The Fencegate job id of a BullMQ job (default `bullmq:<queue>:<job id>`). */
  jobId?: (job: BullJob<T>) => string;
  /** The lease's TTL; it is renewed in the background at a third of it. */
  ttlSeconds?: number;
  /** A name for this worker process, the start of each run's owner (default host:pid). */
  worker?: string;
  /** How long a run waits for an earlier run's lease to end before it fails (ms). */
  acquireTimeoutMs?: number;
}

export interface FencedRun {
  /** This run's lease: write through the gateway with `lease.post(...)`, a key per step. */
  lease: Lease;
  /** Aborted when a background renewal finds the lease lost. */
  signal: AbortSignal;
}

/**
 * A BullMQ processor that runs `work` under a Fencegate lease of its own. Success
 * completes the Fencegate job with the result; a failure releases the lease and is
 * thrown on to BullMQ (which retries as the job's `attempts` say). A run of a job that
 * Fencegate already has as completed returns the stored result without running `work`.
 */
export function fencedProcessor<T = unknown, R = unknown>(
  fencegate: Fencegate,
  work: (job: BullJob<T, R>, run: FencedRun) => Promise<R>,
  options: FencedProcessorOptions<T> = {},
): Processor<T, R> {
  const worker = options.worker ?? `${hostname()}:${process.pid}`;
  return async (job) => {
    const jobId = options.jobId?.(job) ?? `bullmq:${job.queueName}:${job.id ?? ""}`;
    const aborted = new AbortController();
    const lease = await acquire(fencegate, jobId, {
      owner: `${worker}:${randomUUID()}`,
      ttlSeconds: options.ttlSeconds,
      timeoutMs: options.acquireTimeoutMs ?? 60_000,
      onLost: (error) => aborted.abort(error),
    });
    if (!("token" in lease)) return lease.result as R;
    let result: R;
    try {
      result = await work(job, { lease, signal: aborted.signal });
    } catch (error) {
      lease.stopRenewing();
      if (!(error instanceof LeaseLost)) await lease.release().catch(() => undefined);
      throw error;
    }
    await lease.complete(result);
    return result;
  };
}

async function acquire(
  fencegate: Fencegate,
  jobId: string,
  options: {
    owner: string;
    ttlSeconds: number | undefined;
    timeoutMs: number;
    onLost: (error: Error) => void;
  },
): Promise<Lease | { result: unknown }> {
  const started = performance.now();
  for (;;) {
    try {
      return await fencegate.acquire(jobId, {
        owner: options.owner,
        ttlSeconds: options.ttlSeconds,
        onLost: options.onLost,
      });
    } catch (error) {
      if (error instanceof JobFinished) {
        const job = await fencegate.getJob(jobId);
        if (job.state === "completed") return { result: job.result };
        throw error;
      }
      if (!(error instanceof LeaseHeld)) throw error;
      const waited = performance.now() - started;
      if (waited >= options.timeoutMs) throw error;
      // The server's clock decides when the lease ends; the time it names only paces
      // the next try (at most a second away, never past the timeout).
      const until = Date.parse(error.leaseExpiresAt ?? "") - Date.now();
      const pause = Math.min(Math.max(Number.isNaN(until) ? 250 : until + 25, 25), 1_000);
      await new Promise((resolve) => setTimeout(resolve, Math.min(pause, options.timeoutMs - waited)));
    }
  }
}
