import assert from "node:assert/strict";
import { fork, type ChildProcess } from "node:child_process";
import { once } from "node:events";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import { Queue, QueueEvents, Worker } from "bullmq";

import { Fencegate } from "../src/index.js";
import { fencedProcessor } from "../src/bullmq.js";
import { Gateway, Redis, WORKER_TOKEN, stopChild } from "./support.js";

const gateway = new Gateway();
const redis = new Redis();
const stopped: Array<() => Promise<unknown>> = [];
before(async () => {
  await Promise.all([gateway.start(), redis.start()]);
});
after(async () => {
  for (const stop of stopped.reverse()) await stop().catch(() => undefined);
  await Promise.all([gateway.stop(), redis.stop()]);
});

interface Said {
  step: string;
  reason?: string;
  sent?: string;
  generation?: number;
}

function next(child: ChildProcess, step: string): Promise<Said> {
  return new Promise((resolve, reject) => {
    const onMessage = (message: Said): void => {
      if (message.step !== step) return;
      child.off("message", onMessage);
      resolve(message);
    };
    child.on("message", onMessage);
    child.once("exit", (code) => reject(new Error(`worker A exited (${code}) before ${step}`)));
  });
}

test("a stalled BullMQ processor's late write is refused and the retried step replayed", async () => {
  const connection = { host: "127.0.0.1", port: redis.port, maxRetriesPerRequest: null };
  const queue = new Queue("charges", { connection });
  const events = new QueueEvents("charges", { connection });
  stopped.push(() => queue.close(), () => events.close());
  await events.waitUntilReady();

  // Worker A, in a process of its own, takes the job and charges.
  const a = fork(fileURLToPath(new URL("./stalling-worker.js", import.meta.url)), {
    env: {
      ...process.env,
      CONTROL_URL: gateway.controlUrl,
      PROXY_URL: gateway.proxyUrl,
      WORKER_TOKEN,
      REDIS_PORT: String(redis.port),
      QUEUE: "charges",
    },
    stdio: ["ignore", "inherit", "inherit", "ipc"],
  });
  stopped.push(() => stopChild(a));
  await next(a, "ready");
  const job = await queue.add("charge", { amount: 5 }, { attempts: 3 });
  const charged = await next(a, "charged");
  assert.equal(charged.generation, 1);
  // Then it stops, as a paused VM does: no lock extension, no lease renewal.
  a.kill("SIGSTOP");
  const late = next(a, "receipt");

  // BullMQ finds the job stalled and runs it again on worker B, which waits for A's
  // Fencegate lease to end, holds the next generation and redoes both steps.
  const fencegate = new Fencegate({
    controlUrl: gateway.controlUrl,
    proxyUrl: gateway.proxyUrl,
    token: WORKER_TOKEN,
  });
  const replays: boolean[] = [];
  const b = new Worker(
    "charges",
    fencedProcessor<{ amount: number }>(
      fencegate,
      async (run, { lease }) => {
        const charge = await lease.post("pay", "v1/charges", {
          key: `${run.id}:charge`,
          json: run.data,
        });
        replays.push(charge.replayed);
        await lease.post("pay", "v1/receipts", { key: `${run.id}:receipt`, json: run.data });
        return { charged: run.data.amount, generation: lease.generation };
      },
      { ttlSeconds: 5, worker: "worker-b" },
    ),
    { connection, stalledInterval: 500, lockDuration: 5_000 },
  );
  stopped.push(() => b.close());
  const completed = once(events, "completed");
  const [done] = (await completed) as [{ jobId: string; returnvalue: unknown }];
  assert.equal(done.jobId, job.id);
  assert.deepEqual(done.returnvalue, { charged: 5, generation: 2 });
  assert.deepEqual(replays, [true]); // the charge was replayed, not sent again

  // A wakes up and writes its receipt: refused at the gateway, nothing sent.
  a.kill("SIGCONT");
  const said = await late;
  assert.equal(said.reason, "stale-generation");
  assert.equal(said.sent, "never");

  const reached = gateway.upstream.received.map((r) => `${r.path} gen ${r.headers["fencing-generation"]}`);
  assert.deepEqual(reached, ["/v1/charges gen 1", "/v1/receipts gen 2"]);
  const fenced = await fencegate.getJob(`bullmq:charges:${job.id}`);
  assert.equal(fenced.state, "completed");
});
