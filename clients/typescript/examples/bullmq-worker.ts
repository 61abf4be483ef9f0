import { Queue, QueueEvents, Worker } from "bullmq";
import { Fencegate } from "@fencegate/client";
import { fencedProcessor } from "@fencegate/client/bullmq";

const connection = {
  host: "127.0.0.1",
  port: Number(process.env.REDIS_PORT ?? 6379),
  maxRetriesPerRequest: null,
};
const fencegate = new Fencegate({
  controlUrl: process.env.FENCEGATE_CONTROL ?? "http://127.0.0.1:8081",
  proxyUrl: process.env.FENCEGATE_PROXY ?? "http://127.0.0.1:8080",
  token: process.env.FENCEGATE_WORKER_TOKEN,
});

// Every run of a job (a retry, a stalled job's re-run) holds a Fencegate lease of its
// own: a stalled run that wakes up late is refused stale-generation at the gateway.
const worker = new Worker(
  "charges",
  fencedProcessor<{ order: number; amount: number }>(
    fencegate,
    async (job, { lease }) => {
      const charge = await lease.post("payments", "v1/charges", {
        key: `charge-${job.data.order}`,
        json: { amount: job.data.amount },
      });
      return charge.json();
    },
    { ttlSeconds: 30 },
  ),
  { connection, lockDuration: 30_000 },
);

const queue = new Queue("charges", { connection });
const events = new QueueEvents("charges", { connection });
await events.waitUntilReady();
const job = await queue.add("charge", { order: 10, amount: 700 });
console.log("charged", await job.waitUntilFinished(events));

await Promise.all([worker.close(), queue.close(), events.close()]);
