import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, test } from "node:test";

import createClient from "openapi-fetch";

import {
  Fencegate,
  LeaseHeld,
  OutcomeUnknown,
  StaleGeneration,
  UnknownUpstream,
  errorFromProblem,
  RemoteError,
} from "../src/index.js";
import type { paths } from "../src/schema.js";
import { Gateway, WORKER_TOKEN } from "./support.js";

const gateway = new Gateway();
before(() => gateway.start());
after(() => gateway.stop());

function fencegate(): Fencegate {
  return new Fencegate({
    controlUrl: gateway.controlUrl,
    proxyUrl: gateway.proxyUrl,
    token: WORKER_TOKEN,
  });
}

test("a client generated from docs/openapi.json with the tools' defaults does a job", async () => {
  const control = createClient<paths>({
    baseUrl: gateway.controlUrl,
    headers: { Authorization: `Bearer ${WORKER_TOKEN}` },
  });
  const proxy = createClient<paths>({ baseUrl: gateway.proxyUrl });

  // Optional fields are optional: {queue, payload} is a whole request.
  const job = await control.POST("/v1/jobs", {
    body: { queue: "generated", payload: { order: 9 } },
  });
  assert.equal(job.response.status, 201);
  const claim = await control.POST("/v1/queues/{queue}/claim", {
    params: { path: { queue: "generated" } },
    body: { owner: "generated-worker" },
  });
  assert.equal(claim.response.status, 200);
  const token = claim.data!.lease_token;

  // A JSON body as it is, and a nested upstream path through the {path} parameter.
  const write = () =>
    proxy.POST("/{upstream}/{path}", {
      params: {
        path: { upstream: "pay", path: "v1/charges" },
        header: { "Fencing-Token": token, "Idempotency-Key": "charge-1" },
      },
      body: { amount: 700 },
    });
  const first = await write();
  assert.equal(first.response.status, 201);
  const reached = gateway.upstream.received.at(-1)!;
  assert.equal(reached.path, "/v1/charges");
  assert.equal(reached.headers["content-type"], "application/json");
  assert.deepEqual(JSON.parse(reached.body), { amount: 700 });
  const count = gateway.upstream.received.length;
  const again = await write();
  assert.equal(again.response.status, 201);
  assert.equal(again.response.headers.get("Idempotent-Replayed"), "true");
  assert.equal(gateway.upstream.received.length, count);

  const done = await control.POST("/v1/leases/complete", { body: { lease_token: token } });
  assert.equal(done.data?.state, "completed");
});

test("a worker claims, renews in the background, writes a step and completes", async () => {
  const fg = fencegate();
  await fg.enqueue({ queue: "mail", job_id: "mail-1", payload: { to: "a@example.com" } });
  const lease = (await fg.claim("mail", { owner: "w-1", ttlSeconds: 1.2 }))!;
  assert.equal(lease.jobId, "mail-1");
  assert.deepEqual(lease.payload, { to: "a@example.com" });
  // Past its TTL: still current, because it renewed itself at a third of it.
  await new Promise((r) => setTimeout(r, 2_000));
  const sent = await lease.post("pay", "v1/mails", { key: "send-1", json: { to: "a" } });
  assert.equal(sent.status, 201);
  assert.equal(sent.replayed, false);
  assert.equal(sent.sent, undefined); // the upstream's answer: nothing for the gateway to say
  const replayed = await lease.post("pay", "v1/mails", { key: "send-1", json: { to: "a" } });
  assert.equal(replayed.replayed, true);
  assert.deepEqual(replayed.json(), sent.json());
  const job = await lease.complete({ sent: true });
  assert.equal(job.state, "completed");
  assert.equal(lease.lost, undefined);
});

test("a stale write is refused as StaleGeneration, sent never", async () => {
  const fg = fencegate();
  const first = await fg.acquire("order-7", { owner: "w-1", ttlSeconds: 30 });
  // The same owner acquiring again (a restart) fences its predecessor off.
  const second = await fg.acquire("order-7", { owner: "w-1", ttlSeconds: 30 });
  assert.equal(second.generation, first.generation + 1);
  await second.post("pay", "charges", { key: "charge", json: { amount: 1 } });
  const refused = await first.post("pay", "charges", { key: "charge-2", json: { amount: 2 } }).then(
    () => assert.fail("the stale write went through"),
    (error: unknown) => error,
  );
  assert.ok(refused instanceof StaleGeneration, String(refused));
  assert.equal(refused.sent, "never");
  assert.equal(refused.newKeySafe, true);
  assert.equal(refused.problem.highest_generation, second.generation);
  // Without throwing: the answer and its `sent`.
  const answer = await first.post("pay", "charges", {
    key: "charge-3",
    json: {},
    throwOnProblem: false,
  });
  assert.equal(answer.status, 409);
  assert.equal(answer.sent, "never");
  first.stopRenewing();
  await second.release();
});

test("lease-held says until when; the proxy listener points lease calls to the control one", async () => {
  const fg = fencegate();
  const held = await fg.acquire("held-1", { owner: "w-1", ttlSeconds: 30 });
  const error = await fg.acquire("held-1", { owner: "w-2" }).catch((e: unknown) => e);
  assert.ok(error instanceof LeaseHeld, String(error));
  assert.match(error.leaseExpiresAt ?? "", /Z$/);
  assert.ok(error.detail.includes(`until ${error.leaseExpiresAt}`), error.detail);
  assert.equal(error.sent, undefined); // the lease API answers no write
  await held.release();

  const wrong = await fetch(`${gateway.proxyUrl}/v1/jobs`, { method: "POST", body: "{}" });
  const problem = (await wrong.json()) as { reason: string; detail: string };
  const asError = errorFromProblem({ status: wrong.status, ...problem });
  assert.ok(asError instanceof UnknownUpstream);
  assert.ok(problem.detail.includes(new URL(gateway.controlUrl).host), problem.detail);
});

test("every reason named here is one the document knows, sent as the document says", () => {
  const doc = JSON.parse(
    readFileSync(new URL("../../../../docs/openapi.json", import.meta.url), "utf8"),
  ) as { components: { schemas: Record<string, { properties?: Record<string, { const?: string; enum?: string[] }> }> } };
  const reasons = doc.components.schemas["Problem"]!.properties!["reason"]!.enum!;
  for (const reason of ["outcome-unknown", "stale-generation", "lease-held", "unknown-upstream"]) {
    assert.ok(reasons.includes(reason), reason);
  }
  const outcome = errorFromProblem({ status: 409, reason: "outcome-unknown", sent: "maybe" });
  assert.ok(outcome instanceof OutcomeUnknown);
  assert.equal(outcome.newKeySafe, false);
  assert.equal(doc.components.schemas["Problem-outcome-unknown"]!.properties!["sent"]!.const, "maybe");
  assert.ok(errorFromProblem({ status: 418, reason: "something-new" }) instanceof RemoteError);
});
