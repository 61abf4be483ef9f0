/**
 * Worker A of the BullMQ test, a process of its own so that the test can stop it
 * (SIGSTOP, a stopped VM) and let it run again later. It charges (step 1), tells the test,
 * then writes the receipt (step 2) half a second later: after the test has stopped it,
 * that write is late. It tells the test what the gateway answered.
 */

import { Worker } from "bullmq";

import { Fencegate, FencegateError } from "../src/index.js";
import { fencedProcessor } from "../src/bullmq.js";

const env = (name: string): string => {
  const value = process.env[name];
  if (value === undefined) throw new Error(`${name} is not set`);
  return value;
};
const tell = (message: unknown): void => {
  process.send?.(message);
};

const fencegate = new Fencegate({
  controlUrl: env("CONTROL_URL"),
  proxyUrl: env("PROXY_URL"),
  token: env("WORKER_TOKEN"),
});
const worker = new Worker(
  env("QUEUE"),
  fencedProcessor<{ amount: number }>(
    fencegate,
    async (job, { lease }) => {
      await lease.post("pay", "v1/charges", { key: `${job.id}:charge`, json: job.data });
      tell({ step: "charged", generation: lease.generation });
      await new Promise((resolve) => setTimeout(resolve, 500));
      try {
        await lease.post("pay", "v1/receipts", { key: `${job.id}:receipt`, json: job.data });
        tell({ step: "receipt", reason: "forwarded" });
      } catch (error) {
        const reason = error instanceof FencegateError ? error.reason : String(error);
        const sent = error instanceof FencegateError ? error.sent : undefined;
        tell({ step: "receipt", reason, sent });
        throw error;
      }
      return { charged: job.data.amount };
    },
    { ttlSeconds: 1, worker: "worker-a" },
  ),
  {
    connection: { host: "127.0.0.1", port: Number(env("REDIS_PORT")), maxRetriesPerRequest: null },
    lockDuration: 1_000,
    stalledInterval: 500,
  },
);
worker.on("error", () => undefined); // its lock is gone when it wakes: BullMQ says so here
worker.on("failed", (_job, error) => tell({ step: "failed", reason: String(error) }));
tell({ step: "ready" });
