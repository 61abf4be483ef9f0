import { Fencegate, FencegateError } from "@fencegate/client";

const fencegate = new Fencegate({
  controlUrl: process.env.FENCEGATE_CONTROL ?? "http://127.0.0.1:8081",
  proxyUrl: process.env.FENCEGATE_PROXY ?? "http://127.0.0.1:8080",
  token: process.env.FENCEGATE_WORKER_TOKEN,
});

await fencegate.enqueue({ queue: "orders", payload: { order: 9, amount: 700 } });

const lease = await fencegate.claim("orders", { owner: "worker-1", ttlSeconds: 30 });
if (lease !== undefined) {
  const { order, amount } = lease.payload as { order: number; amount: number };
  try {
    // One key per step: a retry of this step, in this or a later generation, is replayed.
    const charge = await lease.post("payments", "v1/charges", {
      key: `charge-${order}`,
      json: { amount },
    });
    console.log("charged", charge.status, charge.json());
    await lease.complete(charge.json());
  } catch (error) {
    if (error instanceof FencegateError) {
      // sent: never, maybe or yes. Only "never" allows the write again under a new key.
      console.log("refused", error.reason, "sent", error.sent);
    }
    await lease.release().catch(() => undefined);
    throw error;
  }
}
